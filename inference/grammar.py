"""Structured outputs: a request's `structured` spec compiled by xgrammar into a grammar over the served vocabulary
(cached by spec), one matcher per sequence, the batched token mask applied to the logits before sampling and the
accept of every sampled token. Specs (JSON-ready, stored in the request's params):
  {"type": "json_schema", "schema": {...}, "strict"?: bool}   {"type": "json_object"}
  {"type": "regex", "pattern": "..."}   {"type": "choice", "choices": ["a", ...]}   {"type": "grammar", "ebnf": "..."}
  {"type": "structural_tag", "structural_tag": {...}}  (xgrammar's structural tag: tool calls, inference/tools.py)"""
import json
import re
import threading
from collections import OrderedDict

import torch
import xgrammar as xgr

from inference.sequence import SeqStatus

SPEC_TYPES = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
CACHE_SIZE = 256  # compiled grammars kept per compiler (least recently used dropped first)
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[04:17:34] /project/cpp/x.cc:94: " on xgrammar's errors


class GrammarError(ValueError):
    """A spec that does not compile; its message says why (xgrammar's own words)."""


def spec_key(spec: dict) -> str:
    """The canonical JSON of a spec: equal specs, however their keys were ordered, share one compiled grammar."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _ebnf_literal(text: str) -> str:
    return json.dumps(text)  # a double-quoted string with \" \\ \n \uXXXX escapes, as xgrammar's EBNF reads them


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer and logits width, with an LRU of compiled grammars (and of refusals:
    a bad spec is compiled once) keyed by `spec_key`. Thread-safe (the web process compiles from many threads)."""

    def __init__(self, tokenizer, vocab_width: int | None = None, cache_size: int = CACHE_SIZE):
        width = max(vocab_width or 0, tokenizer.vocab_size)
        # the raw bytes each token adds (nothing for a special token, which the grammar never allows); ids past
        # the tokenizer's vocabulary (logits padded wider) are never allowed either
        vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.vocab_width = width
        self.stop_ids = list(tokenizer.eos_ids)
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=width, stop_token_ids=self.stop_ids)
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar | GrammarError] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: dict) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it was compiled before; GrammarError when it
        does not compile."""
        key = spec_key(spec)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self.hits += 1
                self._cache.move_to_end(key)
            else:
                self.misses += 1
                found = self._compile(spec)
                self._cache[key] = found
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found

    def _compile(self, spec: dict) -> xgr.CompiledGrammar | GrammarError:
        try:
            return self._build(spec)
        except GrammarError as exc:
            return exc
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, its own JSON/structural-tag errors
            return GrammarError(_CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__)

    def _build(self, spec: dict) -> xgr.CompiledGrammar:
        kind = spec.get("type") if isinstance(spec, dict) else None
        compiler = self._xgr
        if kind == "json_schema":
            # one line, ", " and ": " separators: a small model cannot wander into endless whitespace
            return compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False,
                                                strict_mode=spec.get("strict") is not False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(spec["pattern"])
        if kind == "choice":
            choices = spec["choices"]
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("choices must be a non-empty list of non-empty strings")
            return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
        if kind == "grammar":
            return compiler.compile_grammar(spec["ebnf"])
        if kind == "structural_tag":
            return compiler.compile_structural_tag(spec["structural_tag"])
        raise GrammarError(f"unknown structured output type {kind!r}: one of {', '.join(SPEC_TYPES)}")

    def matcher(self, spec: dict) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(spec))


_COMPILERS: dict[tuple[int, int], tuple[object, GrammarCompiler]] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer, vocab_width: int | None = None) -> GrammarCompiler:
    """The process's compiler for `tokenizer` (kept with it) and logits width."""
    key = (id(tokenizer), vocab_width or tokenizer.vocab_size)
    with _COMPILERS_LOCK:
        entry = _COMPILERS.get(key)
        if entry is None or entry[0] is not tokenizer:
            entry = _COMPILERS[key] = (tokenizer, GrammarCompiler(tokenizer, vocab_width))
        return entry[1]


class SeqGrammar:
    """One sequence's grammar state: its matcher, fed every token the sequence produced."""

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def grammar_attach(seq, tokenizer, vocab_width: int, replay=()) -> SeqGrammar | None:
    """Gives `seq` its grammar (none when its params have no `structured` spec) after replaying `replay` and the
    tokens it already produced: the decode side rebuilds the state prefill left with the handoff's first token.
    GrammarError when the spec does not compile or a replayed token breaks the grammar (before anything is
    reserved for the sequence)."""
    spec = seq.params.structured
    if not spec:
        return None
    state = SeqGrammar(compiler_for(tokenizer, vocab_width).matcher(spec))
    for token in [*seq.output_ids, *replay]:
        if not state.accept(token):
            raise GrammarError(f"token {token} already produced for {seq.request_id} breaks its grammar")
    seq.grammar = state
    return state


def grammar_mask(logits: torch.Tensor, seqs, tokenizer) -> None:
    """Masks, in place, the logits rows of the sequences with a grammar: every token the grammar does not allow
    next (eos only where the grammar may end) is -inf. One bitmask for the batch, filled per grammar row
    (a sequence meeting its grammar here for the first time gets it now, replaying what it produced)."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.structured]
    if not rows:
        return
    width = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), width)
    for j, i in enumerate(rows):
        seq = seqs[i]
        state = seq.grammar or grammar_attach(seq, tokenizer, width)
        if state.terminated:  # ended (its stop token accepted under ignore_eos): only a stop token follows
            bitmask[j] = 0
            for stop in state.matcher.stop_token_ids:
                bitmask[j, stop // 32] |= 1 << (stop % 32)
        else:
            state.matcher.fill_next_token_bitmask(bitmask, j)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
    else:  # CUDA (no triton here) or another dtype: the bitmask expanded with torch ops on the logits' device
        expanded = _unpack(bitmask.to(logits.device), width)
        logits[rows] = logits[rows].masked_fill(~expanded, float("-inf"))


def _unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, ceil(width / 32)] int32 words -> [rows, width] bool (bit k of word w: token 32 w + k allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :width].bool()


def grammar_accept(seqs, tokens: list[int]) -> None:
    """Feeds each sequence's grammar the token sampled for it. A grammar that has ended (its stop token accepted)
    finishes its sequence ("stop"); a token the grammar refuses (no valid token was left to sample) fails it."""
    for seq, token in zip(seqs, tokens):
        state = seq.grammar
        if state is None:
            continue
        if not state.terminated and not state.accept(token):
            seq.status, seq.error = SeqStatus.FAILED, f"sampled token {token} is outside the request's grammar"
        elif state.terminated and seq.finish_reason is None:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "stop"
