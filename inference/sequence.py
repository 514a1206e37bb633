"""One request inside an engine: its tokens, sampling parameters, pages and lifecycle."""
import enum
import random
from dataclasses import dataclass

from inference.kv_cache import cdiv


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none computed; n: each token's log-probability and the n most likely
    tenant: str = ""  # who asked: the engine's waiting queue takes turns between tenants (inference.fair_queue)
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max; 0 means off
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency_penalty * count in the output
    presence_penalty: float = 0.0  # OpenAI: logit -= presence_penalty if in the output
    repetition_penalty: float = 1.0  # vLLM: a prompt or output token's logit divided (> 0) or multiplied (< 0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings not searched, until this many outputs
    stop_token_ids: tuple[int, ...] = ()  # end the sequence ("stop"), their text not in the output
    include_stop_str_in_output: bool = False  # the stop string that ended it stays in the text
    structured: dict | None = None  # a structured-output spec (inference.grammar): every token obeys its grammar

    def __post_init__(self):
        if self.top_k == -1:  # vLLM's "off"
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 (or -1) are required")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be None or 0..20")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in 0..1")
        if not (-2 <= self.frequency_penalty <= 2 and -2 <= self.presence_penalty <= 2):
            raise ValueError("frequency_penalty and presence_penalty must be in -2..2")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids >= 0, biases in -100..100")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in 0..max_tokens")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        if self.seed is None:
            object.__setattr__(self, "seed", random.getrandbits(63))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1  # below 1e-5 sampling is argmax anyway


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no pages yet
    PREFILLING = "prefilling"  # pages held, prompt partly cached
    RUNNING = "running"  # decoding
    PREFILLED = "prefilled"  # prefill-only request done: KV ready for the handoff
    FINISHED = "finished"
    FAILED = "failed"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prefill_only: bool = False,
                 salt: str | None = None):
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.prefill_only = prefill_only
        self.output_ids: list[int] = []
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.page_epochs: list[int] = []
        self.num_cached = 0  # tokens whose K/V are in this sequence's pages
        self.salt = salt  # its prefix-cache scope (derived by the server); None: it neither reads nor fills the cache
        self.num_shared = 0  # leading pages of block_table read from the prefix cache (never written)
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache (usage)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text = ""  # detokenized output so far, stop strings removed
        self.text_stream = None  # the incremental detokenizer (inference.tokenizer.TextStream), made by the engine
        self.transfer_ms: float | None = None  # time to pull the handoff's KV (decode side)
        self.read_record: dict | None = None  # set when the sequence finishes (BlockManager.read_record)
        self.num_preemptions = 0  # times its pages were taken back and it was recomputed
        self.grammar = None  # its structured-output matcher (inference.grammar.SeqGrammar), when params.structured
        # one of a request's n choices (inference.choices): the request, the choice's index, the scope of the
        # prompt pages it shares with its siblings (its own salt stays None: a choice neither reads nor fills
        # the prefix cache), its log-probability so far, and whether its logprobs were computed only to rank it
        self.choice_of: str | None = None
        self.index = 0
        self.share_scope: str | None = None
        self.cumulative_logprob: float | None = None
        self.score_only = False
        # a prefill of n choices: the parameters of choices 1..n-1, then every choice's first token and logprobs
        self.choice_params: list[SamplingParams] = []
        self.choice_tokens: list[int] = []
        self.choice_logprobs: list = []

    @property
    def tenant(self) -> str:
        return self.params.tenant

    @property
    def owner_request(self) -> str:
        """The request this sequence answers (itself, or the request whose choice it is)."""
        return self.choice_of or self.request_id

    @property
    def scope(self) -> str | None:
        """The scope of the shared pages at the start of its block table: its choice group's, else its salt."""
        return self.share_scope or self.salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_done(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.FAILED, SeqStatus.PREFILLED)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def num_pages_needed(self, page_size: int) -> int:
        """Pages for the whole request: prompt plus every token it may generate (admission's bound; a
        sequence holds only what it has written, plus the page it writes)."""
        return cdiv(self.num_prompt_tokens + self.params.max_tokens, page_size)

    def __repr__(self):
        return f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, pages={self.block_table})"
