"""The engine the workers run: admit, prefill into pages, export/import pages for the handoff,
decode with continuous batching, release. Every forward pass is preceded by the ownership guard."""
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from inference import admission, native
from inference.allocator import LocalAllocator, PageAllocator, cache_entry
from inference.attention import fresh_kind, select_backend
from inference.block_manager import BlockManager, OwnershipViolation, Violation
from inference.choices import ChoiceGroup, choice_id, choice_params, choice_scope
from inference.faults import NO_FAULTS, Faults
from inference.grammar import grammar_accept, grammar_attach, grammar_mask
from inference.kv_cache import PagePool, cdiv, page_checksums
from inference.loader import LoadedModel, gguf_group8_weights, gguf_group_weights, gguf_has_group_weights, load_model
from inference.precision import GROUPED, Choice, kv_dtype_for, precision_fingerprint, resolve_precision
from inference.model import Llama, choose_gemm
from inference.prefix_cache import PrefixCache
from inference.runner import StepBuilder
from inference.sampling import sample, sampled_logprobs
from inference.scheduler import RequestTooLarge, ScheduledChunk, Scheduler
from inference.sequence import SamplingParams, Sequence, SeqStatus
from inference.settings import engine_settings

log = logging.getLogger(__name__)


class DuplicateRequest(ValueError):
    """A request id the engine already holds: the second copy is refused, the first is left alone."""


# pages kept free for canary probes while other sequences run: the live probes' valid handoff (3 pages, one more
# as it decodes) or guard probe (3 pages) fits (incidents/canary/probes.py)
PROBE_RESERVE_PAGES = 4

@dataclass
class StepEvent:
    seq: Sequence
    token: int | None  # the token sampled this step (None for a failure)
    text_delta: str
    finished: bool
    logprobs: tuple | None = None  # (logprob, ((id, logprob), ...)) of `token`, when its request asked


@dataclass(frozen=True)
class EngineStats:
    """Counters (monotonic) and load of one engine at one moment."""

    scrubbed_pages: int
    guard_checks: int
    num_preemptions: int
    running: int
    waiting: int
    pages: dict[str, int]  # request id -> pages held


@dataclass
class EngineConfig:
    num_pages: int = 1024
    page_size: int = 16
    chunk_size: int = 512
    max_num_seqs: int = 64
    window: int | None = None  # tokens served per request; default: the model's context length
    scrub_policy: str = "on_free"
    dtype: str = "float32"
    precision: str = "fp32"  # matmul precision (inference.precision): fp32, bf16, fp16w or auto (timed at start)
    kv_dtype: str = "auto"  # the KV pool's element type: auto (inference.precision.kv_dtype_for), float32, bfloat16
    device: str = "cpu"
    attention: str | None = None  # None: chosen from the device (KVSERVE_ATTENTION overrides)
    faults: Faults = field(default_factory=lambda: NO_FAULTS)
    pool_mb: int | None = None  # size the pool by memory instead of num_pages
    prefix_cache: bool = False  # keep finished prompts' full pages for requests of the same scope (salt)
    watermark: float = 0.01  # fraction of the pool admission leaves free for running sequences to grow into
    probe_reserve_pages: int = 0  # pages kept free for canary probes while other sequences run (scheduler)
    reserve_whole: bool = False  # bench.ondemand's baseline only: reserve prompt + max_tokens at admission

    def pages_for(self, mc, dtype) -> int:
        """Pages in the pool: num_pages, or as many as fit pool_mb for this model and KV dtype."""
        if not self.pool_mb:
            return self.num_pages
        per_page = PagePool.page_bytes(self.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
        return self.pool_mb * 2**20 // per_page

    @classmethod
    def from_env(cls, **overrides) -> "EngineConfig":
        values = engine_settings()  # inference/settings.py: strict, SettingError naming the variable
        values.update(device=values["device"] or ("cuda" if torch.cuda.is_available() else "cpu"),
                      faults=Faults.from_env())
        if values["probe_reserve_pages"] is None:
            values["probe_reserve_pages"] = PROBE_RESERVE_PAGES
        values.update(overrides)
        return cls(**values)


_BUILD_LOCK = threading.Lock()


def shared_model(model: LoadedModel, dtype: torch.dtype, device: torch.device, attention_backend: str,
                 precision: str = "fp32") -> Llama:
    """The Llama another engine of this process already built from `model` for this dtype, device, attention
    backend and GEMM, else a new one. Its weights are read-only once packed, so engines on one LoadedModel
    (a worker's and its canary sandbox's) share them instead of packing ~0.5 GB each (bench.memory); it is
    freed with the last engine that holds it."""
    key = (str(dtype), str(device), attention_backend, choose_gemm(device, dtype), precision)
    with _BUILD_LOCK:
        llama = model.built.get(key)
        if llama is None:
            groups = gguf_group_weights(model.source) if precision in GROUPED else None
            if precision == "w4a8":  # and the file's Q8_0 blocks (the default model's lm_head)
                groups.update(gguf_group8_weights(model.source))
            llama = Llama(model.config, model.weights, dtype=dtype, device=device, attention_backend=attention_backend,
                          precision=precision, groups=groups)
            del groups  # the codes are packed into the Llama; the unpacked copy goes
            model.built[key] = llama
        return llama


def engine_kv_dtype(config: EngineConfig, precision: str) -> torch.dtype:
    """The KV pool's dtype an engine of `config` keeps in `precision` (a resolved mode, never auto)."""
    return kv_dtype_for(config.kv_dtype, precision, getattr(torch, config.dtype), torch.device(config.device))


def engine_precision(model: LoadedModel, config: EngineConfig) -> Choice:
    """The matmul precision an engine of `config` runs on `model` (`auto`: timed once per process)."""
    dtype, device = getattr(torch, config.dtype), torch.device(config.device)
    grouped = config.precision in GROUPED + ("auto",) and gguf_has_group_weights(model.source)
    return resolve_precision(config.precision, model.config, device, dtype, choose_gemm(device, dtype), grouped)


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None,
                 allocator_factory=None):
        self.loaded = model
        self.config = config = config or EngineConfig()
        mc = model.config
        dtype = getattr(torch, config.dtype)
        device = torch.device(config.device)
        self.attention_backend = config.attention or select_backend(device, dtype)
        self.precision_choice = engine_precision(model, config)
        self.precision = self.precision_choice.mode
        log.info("engine %s", self.precision_choice.line())
        self.model = shared_model(model, dtype, device, self.attention_backend, self.precision)
        kv_dtype = engine_kv_dtype(config, self.precision)
        self.kv_dtype = str(kv_dtype).removeprefix("torch.")  # what the registration and the handoff call `dtype`
        num_pages = config.pages_for(mc, kv_dtype)
        self.pool = PagePool(num_pages, config.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype,
                             device)
        if dtype == torch.float32 and device.type == "cpu":
            fresh_kind(kv_dtype)  # decided (timed once) at start, not by the first prompt's step
        allocator: PageAllocator = (allocator_factory or (lambda n: LocalAllocator(n)))(num_pages)
        self.block_manager = BlockManager(allocator, self.pool, config.scrub_policy, config.faults)
        if not 0 <= config.watermark < 1:
            raise ValueError(f"watermark {config.watermark}: a fraction of the pool in [0, 1)")
        if not 0 <= config.probe_reserve_pages < num_pages:
            raise ValueError(f"KVSERVE_PROBE_RESERVE_PAGES={config.probe_reserve_pages}: set it to 0 or more and "
                             f"fewer than the pool's {num_pages} pages")
        self.scheduler = Scheduler(self.block_manager, config.chunk_size, config.max_num_seqs,
                                   watermark_pages=int(num_pages * config.watermark),
                                   reserve_whole=config.reserve_whole,
                                   probe_reserve_pages=config.probe_reserve_pages)
        self.prefix_cache = PrefixCache(self.block_manager) if config.prefix_cache else None
        if self.prefix_cache is not None:
            pc, sched = self.prefix_cache, self.scheduler
            sched.admit = lambda seq: pc.admit(seq, lambda s: sched.pages_to_admit(s, s.num_tokens),
                                               sched.admission_keep_free(seq))
        admit = self.scheduler.admit
        self.scheduler.admit = lambda seq: self._readmit_choice(seq) if seq.choice_of else admit(seq)
        self.runner = StepBuilder(self.pool, fresh_reads_pool=self.attention_backend == "xformers")
        self.window = config.window or mc.max_position
        self.tokenizer = model.tokenizer
        # the handoff's model identity: KV prefilled in one precision is not the KV another computes (fp32 keeps
        # the bare file fingerprint, which the API reports and older workers register)
        self.fingerprint = precision_fingerprint(model.fingerprint, self.precision)
        self.violations: list[Violation] = []  # since the last take_violations()
        self.seqs: dict[str, Sequence] = {}
        self.groups: dict[str, ChoiceGroup] = {}  # request id -> its choices' shared prompt pages (decode side)
        self.num_decode_tokens = 0
        config.faults.announce(f"engine pool {allocator.pool_id}")

    @classmethod
    def from_env(cls, **overrides) -> "Engine":
        return cls(load_model(), EngineConfig.from_env(**overrides))

    # ---- admission -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def device(self) -> str:
        return str(self.pool.data.device)

    @property
    def scrub_policy(self) -> str:
        return self.block_manager.scrub_policy

    @property
    def effective_limit(self) -> int:
        return admission.serving_limit(self.window, self.capacity_tokens, self.model.config.max_position)

    def admission_error(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run here, or None (inference.admission). Nothing is reserved either way."""
        return admission.admission_error(num_prompt_tokens, max_tokens, self.effective_limit,
                                         f"window {self.window}, pool {self.capacity_tokens}")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, salt: str | None = None, choices: int = 1,
                    score: bool = False) -> Sequence:
        """Queues a request. `salt` (the server-derived scope) lets it reuse and fill the prefix cache.
        `choices` > 1 (a prefill only): the first token of every choice is sampled from the prompt's logits, each
        with its own seed (inference.choices; `score`: with its logprob, to rank best_of)."""
        if request_id in self.seqs or request_id in self.groups:
            raise DuplicateRequest(f"request {request_id} is already in this engine")
        reason = self.admission_error(len(prompt_ids), params.max_tokens * choices)  # prompt once + n x max_tokens
        if reason:
            raise RequestTooLarge(reason)
        if choices > 1 and not prefill_only:
            raise ValueError("a request's choices are forked after its prefill (add_prefilled_choices)")
        plist = choice_params(params, choices, score) if choices > 1 else [params]
        seq = Sequence(request_id, prompt_ids, plist[0], prefill_only, salt if self.prefix_cache is not None else None)
        seq.choice_params, seq.score_only = plist[1:], score and choices > 1
        grammar_attach(seq, self.tokenizer, self.model.config.vocab_size)  # GrammarError: refused, nothing queued
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        return seq

    # ---- handoff ---------------------------------------------------------------------------
    def export_kv(self, seq: Sequence) -> tuple[torch.Tensor, list[str]]:
        """The prompt's pages as a blob (unwritten tail zeroed) and a checksum per page."""
        if seq.status is not SeqStatus.PREFILLED:
            raise ValueError(f"{seq} has not finished prefill")
        n = seq.num_prompt_tokens
        blob = self.pool.export_pages(seq.block_table[: cdiv(n, self.pool.page_size)])
        tail = n % self.pool.page_size
        if tail:
            blob[-1, :, :, tail:] = 0
        return blob, page_checksums(blob)

    def release(self, seq: Sequence) -> None:
        """Frees a sequence's pages (scrubbed by policy) and forgets it."""
        self.scheduler.finish(seq)
        self.runner.release(seq)
        if seq.block_table:
            self.block_manager.deallocate(seq)
        self._leave_group(seq)
        self.seqs.pop(seq.request_id, None)

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int, blob: torch.Tensor,
                      params: SamplingParams, num_transferred: int | None = None) -> Sequence | None:
        """Imports a verified handoff's KV into fresh pages and joins the decode batch.
        The written watermark is what was transferred, never what the prompt claims: a sequence
        that believes more is cached than was written fails the guard on its first step.
        It is admitted with the pages of the prompt it received; it grows as it decodes.
        Returns None when the pages do not fit now, or preempted sequences wait to resume first (the caller
        retries); raises when they never can."""
        if request_id in self.seqs:
            raise DuplicateRequest(f"request {request_id} is already in this engine")
        reason = self.admission_error(len(prompt_ids), params.max_tokens)
        if reason:
            raise RequestTooLarge(reason)
        seq = Sequence(request_id, prompt_ids, params)
        grammar_attach(seq, self.tokenizer, self.model.config.vocab_size, replay=[first_token])  # prefill's state
        if self.scheduler.waits_for_preempted(seq):
            return None
        num_pages = max(blob.shape[0], self.scheduler.pages_to_admit(seq, len(prompt_ids)))
        if not self.block_manager.allocate(seq, num_pages, self.scheduler.admission_keep_free(seq)):
            return None
        self.pool.import_pages(seq.block_table[: blob.shape[0]], blob)
        self.block_manager.mark_written(seq, len(prompt_ids) if num_transferred is None else num_transferred)
        seq.num_cached = len(prompt_ids)
        self.seqs[request_id] = seq
        self._append_token(seq, first_token)
        if seq.is_done:
            self.release(seq)
            self.seqs[request_id] = seq
        else:
            self.scheduler.add_running(seq)
        return seq

    def add_prefilled_choices(self, request_id: str, prompt_ids: list[int], first_tokens: list[int],
                              blob: torch.Tensor, params: list[SamplingParams], num_transferred: int | None = None,
                              first_logprobs: list | None = None, score: bool = False) -> list[Sequence] | None:
        """Forks a verified handoff into the request's n choices (n = len(first_tokens), params[i] choice i's).
        The prompt's full pages are imported once and handed to the request's own scope (a cache entry of
        `choice_scope(request_id)`, never a tenant's): every choice reads them shared, read-only, under that
        scope. Each choice owns the rest: its copy of the partly filled last prompt page (which it writes
        into) and its decode pages. The shared pages are freed and scrubbed when the last choice leaves
        (`_leave_group`). All n are admitted together or not at all: None when they do not fit now (nothing
        is held then); RequestTooLarge when they never can. `score`: logprobs computed only to rank best_of."""
        n, ps, bm = len(first_tokens), self.page_size, self.block_manager
        if request_id in self.seqs or request_id in self.groups:
            raise DuplicateRequest(f"request {request_id} is already in this engine")
        if n < 2 or len(params) != n:
            raise ValueError(f"{n} first tokens and {len(params)} parameters: a fork is of 2 or more choices")
        num_prompt = len(prompt_ids)
        reason = self.admission_error(num_prompt, max(p.max_tokens for p in params) * n)
        written = num_prompt if num_transferred is None else min(num_prompt, num_transferred)
        num_full = written // ps  # only full, written pages are shared; the guard judges the rest per choice
        own = max(1, cdiv(num_prompt, ps) - num_full)  # a choice always owns the page it writes next (the ledger
        # grows only owners that hold pages)
        whole = num_full + sum(cdiv(num_prompt - num_full * ps + p.max_tokens, ps) for p in params)
        if reason is None and whole > self.num_pages:
            reason = f"{n} choices need {whole} pages (the prompt's {num_full} full ones once); the pool has " \
                     f"{self.num_pages}"
        if reason:
            raise RequestTooLarge(reason)
        if blob.shape[0] != cdiv(num_prompt, ps):
            raise ValueError(f"blob of {blob.shape[0]} pages for a prompt of {num_prompt} tokens")
        scope = choice_scope(request_id)
        seqs = []
        for i, p in enumerate(params):
            seq = Sequence(choice_id(request_id, i), prompt_ids, p)
            seq.choice_of, seq.index, seq.share_scope, seq.score_only = request_id, i, scope, score
            grammar_attach(seq, self.tokenizer, self.model.config.vocab_size, replay=[first_tokens[i]])
            seqs.append(seq)
        if self.scheduler.waits_for_preempted(seqs[0]):
            return None
        free, keep = bm.num_free(), self.scheduler.admission_keep_free(seqs[0])
        if free is not None and free < num_full + n * own + keep:
            if self.prefix_cache is None or self.prefix_cache.evict(num_full + n * own + keep) == 0:
                return None
        group = ChoiceGroup(scope, [], [], {s.request_id for s in seqs})
        self.groups[request_id] = group
        holder = seqs[0]
        try:
            if num_full:
                if not bm.allocate(holder, num_full):
                    return self._unfork(request_id, seqs)
                self.pool.import_pages(holder.block_table, blob[:num_full])
                bm.mark_written(holder, num_full * ps)
                if bm.cache_pages(holder, list(range(num_full))) is None:  # the ledger did not take them
                    self._unfork(request_id, seqs)
                    raise RuntimeError(f"the ledger refused the shared prompt pages of {request_id}")
                group.pages, group.epochs = list(holder.block_table), list(holder.page_epochs)
                holder.block_table, holder.page_epochs = [], []
            for seq in seqs:
                if not bm.share(seq, group.pages, group.epochs) or not bm.allocate(seq, own):
                    return self._unfork(request_id, seqs)
                if blob.shape[0] > num_full:  # its own copy of the partly filled (or unwritten) prompt pages
                    self.pool.import_pages(seq.block_table[num_full:blob.shape[0]], blob[num_full:])
                bm.mark_written(seq, written)
                seq.num_cached = num_prompt
        except BaseException:
            if request_id in self.groups:
                self._unfork(request_id, seqs)
            raise
        for seq, token, lp in zip(seqs, first_tokens, first_logprobs or [None] * n):
            self.seqs[seq.request_id] = seq
            if lp is not None:
                seq.cumulative_logprob = float(lp[0])
            self._append_token(seq, token)
        for seq in seqs:
            if seq.is_done:
                seq.read_record = bm.read_record(seq)
                self.release(seq)
                self.seqs[seq.request_id] = seq
            else:
                self.scheduler.add_running(seq)
        return seqs

    def _readmit_choice(self, seq: Sequence) -> bool:
        """A preempted choice resumes on its request's shared prompt pages (held while any of its choices is here):
        it reads them again and recomputes only what it owns, so the choices never need more than admission
        counted (the prompt once). False when its own pages do not fit now (nothing held then)."""
        bm, group = self.block_manager, self.groups.get(seq.choice_of)
        if group is not None and group.pages and not bm.share(seq, group.pages, group.epochs):
            return False
        if not bm.allocate(seq, self.scheduler.pages_to_admit(seq, seq.num_tokens),
                           self.scheduler.admission_keep_free(seq)):
            bm.unshare(seq)
            return False
        seq.num_cached = seq.num_shared * self.page_size
        return True

    def _unfork(self, request_id: str, seqs: list[Sequence]) -> None:
        """A fork that did not fit: whatever its choices took goes back (scrubbed), the shared pages last."""
        for seq in seqs:
            if seq.block_table:
                self.block_manager.deallocate(seq)
            self._leave_group(seq)
        return None

    def _leave_group(self, seq: Sequence) -> None:
        """A choice holds no pages any more; after the last one its request's shared prompt pages go (no reader is
        left: each choice's reads ended with its pages), scrubbed like any freed page."""
        group = self.groups.get(seq.choice_of) if seq.choice_of else None
        if group is None:
            return
        group.members.discard(seq.request_id)
        if not group.members:
            del self.groups[seq.choice_of]
            if group.pages:
                self.block_manager.evict_pages(group.scope, group.pages, group.epochs)

    def abort(self, request_id: str, reason: str = "aborted") -> Sequence | None:
        """Ends the request whatever its state and takes it out of the engine: one still running, or done but
        still holding pages (a prefill awaiting its export, a finish whose release failed midway), fails with
        `reason` and every page it holds is freed and scrubbed (never cached). The sequence, or None when the
        engine had none."""
        if request_id in self.groups:  # every choice of the request
            choices = [self.seqs.get(m) for m in sorted(self.groups[request_id].members)]
            ended = [self.abort(seq.request_id, reason) for seq in choices if seq is not None]
            if request_id in self.groups:  # members that were never admitted here
                self._unfork(request_id, [])
                self.groups.pop(request_id, None)
            return ended[0] if ended else None
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        if not seq.is_done or seq.block_table:
            seq.status, seq.error = SeqStatus.FAILED, reason
        self.release(seq)
        return seq

    # ---- state the engine's host reads and hands back ---------------------------------------
    def has_request(self, request_id: str) -> bool:
        return request_id in self.seqs or request_id in self.groups

    def pages_of(self, request_id: str) -> tuple[list[int], list[int]] | None:
        """(pages, epochs) a running request holds, or None."""
        seq = self.seqs.get(request_id)
        return (list(seq.block_table), list(seq.page_epochs)) if seq is not None and seq.block_table else None

    def held_by(self, owner: str) -> tuple[list[int], list[int], list[int]]:
        """What the ledger should list for `owner`, as this engine sees it: (pages, epochs, cached pages it reads).
        A request's own pages (after the shared prefix it reads, whose real owner is the cache entry); a cache
        entry's pages in the prefix index."""
        seq = self.seqs.get(owner)
        if seq is not None:
            k = seq.num_shared
            return list(seq.block_table[k:]), list(seq.page_epochs[k:]), list(seq.block_table[:k])
        for group in self.groups.values():  # a request scope's entry: its choices' shared prompt pages
            if cache_entry(group.scope) == owner:
                return list(group.pages), list(group.epochs), []
        cached = self.prefix_cache.entry_pages(owner) if self.prefix_cache is not None else []
        return [c.page for c in cached], [c.epoch for c in cached], []

    def pop_finished(self) -> list[Sequence]:
        """Drops and returns every finished (or failed) sequence the engine still keeps for its caller."""
        done = [seq for seq in self.seqs.values() if seq.is_done and not seq.block_table]
        for seq in done:
            del self.seqs[seq.request_id]
        return done

    def take_violations(self) -> list[Violation]:
        """Ownership violations detected since the last call (each already failed its sequence closed)."""
        taken, self.violations = self.violations, []
        return taken

    def reclaim(self, pages) -> list[Sequence]:
        """The ledger took `pages` back (their owner's lease was reaped). Every sequence still holding one
        fails; its pages and `pages` are scrubbed and forgotten here, without a ledger call (the ledger
        no longer lists them as the sequence's). Returns the failed sequences."""
        pages = {int(p) for p in pages}
        failed = []
        for seq in list(self.seqs.values()):
            if pages.isdisjoint(seq.block_table):
                continue
            seq.status, seq.error = SeqStatus.FAILED, "lease lost"
            self.scheduler.remove(seq)
            self.runner.release(seq)
            own = seq.block_table[seq.num_shared:]
            if pages.issuperset(own):  # its own lease went: the ledger lists nothing of it any more
                self.block_manager.forget_reads(seq)
                pages.update(own)
            else:  # a cached page it read was reaped under it: its own pages go back through the ledger
                self.block_manager.release_all(seq)
            seq.block_table, seq.page_epochs = [], []
            failed.append(seq)
        for request_id, group in list(self.groups.items()):
            if not pages.isdisjoint(group.pages):  # reaped with its entry: forgotten and scrubbed here
                pages.update(group.pages)
                group.pages, group.epochs = [], []
        for seq in failed:
            self._leave_group(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(pages)
        ordered = sorted(pages)
        self.block_manager.forget(ordered)  # scrubs them under on_free
        if self.scrub_policy != "on_free":
            self.pool.scrub(ordered)
        return failed

    def reset_pool(self, reason: str) -> list[Sequence]:
        """The ledger lost this pool (Redis restarted empty, failover, FLUSHDB). Every sequence fails, the
        mirror forgets every page and the whole tensor is zeroed, so nothing written under the old
        generation can be read under the next. Returns the sequences that were still running."""
        failed = [seq for seq in self.seqs.values() if not seq.is_done or seq.block_table]
        for seq in failed:
            seq.status, seq.error = SeqStatus.FAILED, reason
            self.scheduler.remove(seq)
            self.runner.release(seq)
            seq.block_table, seq.page_epochs, seq.num_shared = [], [], 0
        self.seqs, self.groups = {}, {}
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.block_manager.forget(range(self.pool.num_pages))  # scrubs every page under on_free
        if self.scrub_policy != "on_free":
            self.pool.data.zero_()
        return failed

    def stats(self) -> "EngineStats":
        """A snapshot of the engine's counters and load, for its worker's metrics (read off the loop thread)."""
        seqs = list(self.seqs.values())
        return EngineStats(scrubbed_pages=self.pool.num_scrubbed, guard_checks=self.block_manager.num_guard_checks,
                           num_preemptions=self.scheduler.num_preemptions, running=len(self.scheduler.active),
                           waiting=len(self.scheduler.waiting),
                           pages={s.request_id: len(s.block_table) for s in seqs if s.block_table})

    # ---- stepping --------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepEvent]:
        chunks = self.scheduler.schedule()
        for seq in self.scheduler.preempted:  # its pages are freed and scrubbed; it is recomputed later
            self.runner.release(seq)
        events = []
        runnable = []
        for chunk in chunks:
            try:
                self.block_manager.check_reads(chunk.seq, chunk.seq.num_cached, chunk.num_tokens)
                runnable.append(chunk)
            except OwnershipViolation as exc:
                events.append(self._fail_closed(chunk.seq, exc))
        if not runnable:
            return events
        native.wake_threads()
        input_ids, positions, batch, sample_rows = self._prepare(runnable)
        hidden = self.model.forward(input_ids, positions, batch, self.pool)
        to_sample = []
        for chunk in runnable:
            seq = chunk.seq
            self.block_manager.mark_written(seq, seq.num_cached + chunk.num_tokens)
            seq.num_cached += chunk.num_tokens
            if seq.num_cached == seq.num_tokens:  # chunk ended at the newest token: sample the next
                to_sample.append(seq)
        if to_sample:
            logits = self.model.logits(hidden[torch.tensor([sample_rows[s.request_id] for s in to_sample])])
            grammar_mask(logits, to_sample, self.tokenizer)  # structured outputs: tokens outside a grammar are -inf
            tokens = sample(logits, [s.params for s in to_sample], [len(s.output_ids) for s in to_sample],
                            [s.prompt_ids for s in to_sample], [s.output_ids for s in to_sample],
                            self.tokenizer.eos_ids)
            grammar_accept(to_sample, tokens)
            logprobs = sampled_logprobs(logits, tokens, [s.params.logprobs for s in to_sample])
            self._sample_choices(to_sample, logits, tokens, logprobs)
            for seq, token, lp in zip(to_sample, tokens, logprobs):
                events.append(self._on_token(seq, token))
                events[-1].logprobs = self._scored(seq, lp)
        return events

    def _sample_choices(self, seqs: list[Sequence], logits, tokens: list[int], logprobs: list) -> None:
        """A prefill of n choices: the first token of every choice, sampled from the same logits row, each with
        its own seed (choice 0's is the row's own)."""
        for row, seq in enumerate(seqs):
            if seq.prefill_only and seq.choice_params:
                k = len(seq.choice_params)
                rows = logits[row:row + 1].expand(k, -1)
                extra = sample(rows, seq.choice_params, [0] * k, [seq.prompt_ids] * k, [[] for _ in range(k)],
                               self.tokenizer.eos_ids)
                lps = sampled_logprobs(rows, extra, [p.logprobs for p in seq.choice_params])
                seq.choice_tokens, seq.choice_logprobs = [tokens[row], *extra], [logprobs[row], *lps]

    @staticmethod
    def _scored(seq: Sequence, lp):
        """Adds a sampled token's logprob to its choice's cumulative one; what the step event shows of it."""
        if lp is not None and seq.choice_of is not None:
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + float(lp[0])
        return None if seq.score_only else lp

    def _prepare(self, chunks: list[ScheduledChunk]):
        return self.runner.build(chunks)

    def _on_token(self, seq: Sequence, token: int) -> StepEvent:
        if seq.prefill_only:
            seq.output_ids.append(token)
            seq.status = SeqStatus.PREFILLED
            self.scheduler.finish(seq)
            return StepEvent(seq, token, "", True)
        if seq.status is SeqStatus.PREFILLING:
            seq.status = SeqStatus.RUNNING
        delta = self._append_token(seq, token)
        if seq.is_done:
            seq.read_record = self.block_manager.read_record(seq)
            self.release(seq)
            self.seqs[seq.request_id] = seq  # keep results readable until the caller drops them
        return StepEvent(seq, token, delta, seq.is_done)

    def _append_token(self, seq: Sequence, token: int) -> str:
        """Records a sampled token and returns the text it releases. seq.text only ever grows by what
        is returned; an incomplete UTF-8 character and a possible start of a stop string are held
        back until the next token decides them. When the sequence ends (EOS or a stop token id: their text
        left out; a stop string: cut before it, or after it with include_stop_str_in_output; length) the text
        held back for a stop string is released and an incomplete trailing character dropped, never shown
        as U+FFFD. Stop strings are searched once min_tokens outputs are reached (the sampler holds EOS and
        stop token ids back until then)."""
        seq.output_ids.append(token)
        self.num_decode_tokens += 1
        params = seq.params
        stream = seq.text_stream = seq.text_stream or self.tokenizer.stream()
        if (token in self.tokenizer.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return self._finish(seq, "stop", stream.settled)
        searched = min(stream.stable_len, len(stream.settled))  # text before this was searched for stop strings
        stream.push(token)
        text = stream.settled
        if params.stop and len(seq.output_ids) >= params.min_tokens:
            # a stop string found now ends past what was searched (else the last step had found it)
            start = max(0, searched - max(map(len, params.stop)) + 1)
            hits = [(i, -len(s), s) for s in params.stop if s for i in [text.find(s, start)] if i >= 0]
            if hits:
                cut, _, stop = min(hits)
                return self._finish(seq, "stop", text[:cut + len(stop) if params.include_stop_str_in_output else cut])
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.model.config.max_position:
            return self._finish(seq, "length", text)
        safe = len(text)
        for s in params.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text.endswith(s[:k], 0, safe):
                    safe -= k
                    break
        if safe <= len(seq.text):
            return ""
        delta = text[len(seq.text):safe]
        seq.text += delta
        return delta

    @staticmethod
    def _finish(seq: Sequence, reason: str, text: str) -> str:
        """Ends `seq` with its final text (what was released so far is its prefix); returns the rest."""
        delta = text[len(seq.text):] if len(text) > len(seq.text) else ""
        seq.text = text if len(text) >= len(seq.text) else seq.text
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        return delta

    def _fail_closed(self, seq: Sequence, exc: OwnershipViolation) -> StepEvent:
        log.error("ownership violation, request fails closed and worker is quarantined: %s", exc)
        self.violations.append(exc.violation)
        seq.status, seq.error = SeqStatus.FAILED, str(exc)
        seq.text = ""
        self.scheduler.remove(seq)
        self.runner.release(seq)
        self.block_manager.release_all(seq)
        self._leave_group(seq)
        return StepEvent(seq, None, "", True)

    # ---- convenience -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Runs prompts to completion together (tests, CLI, benchmarks)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(f"gen-{time.monotonic_ns()}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        while self.has_work:
            self.step()
        for s in seqs:
            self.seqs.pop(s.request_id, None)
        return seqs
