"""What a request asked for, from the API to the engine: its sampling choices (Sampling), kept apart from who
asked and how its answer is shaped (`user`, `endpoint`). The web layer builds a RequestParams from the validated
body and stores it with the request, versioned (`v`); the workers read it back and sample with
`sampling_params()`. A stored form without `v` (the flat object requests had before) reads as version 1; an
unknown version is refused (ParamsFormatError)."""
from dataclasses import asdict, dataclass, field, replace

from inference.sequence import SamplingParams

VERSION = 1
ENDPOINTS = ("chat", "completions")
_IDENTITY = ("user", "endpoint")  # the legacy flat form's keys that are not sampling choices
_SHAPE = ("tool_calls",)  # keys of how the answer is shaped, stored only when set
_CHOICES = ("n", "best_of")  # stored beside them when set


# Sampling fields handed to SamplingParams under the same name when set (None leaves the engine's default)
_ENGINE_FIELDS = ("top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                  "min_tokens", "stop_token_ids", "include_stop_str_in_output", "ignore_eos")


class ParamsFormatError(ValueError):
    """A stored RequestParams this process cannot read."""


@dataclass(frozen=True)
class Sampling:
    """The sampling choices a request set; None leaves the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # fixed at admission, so that any worker samples the same stream
    stop: tuple[str, ...] | None = None
    logprobs: int | None = None  # each token's log-probability and this many alternatives; None: not asked
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias) pairs
    min_tokens: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    structured: dict | None = None  # a structured-output spec (inference/grammar.py): the output obeys its grammar

    def __post_init__(self):
        if self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class RequestParams:
    sampling: Sampling = field(default_factory=Sampling)
    user: str | None = None  # the request's `user` field: narrows its prefix-cache scope (kvserve/chat/salt.py)
    endpoint: str = "chat"  # whose shape its answer takes: "chat" (chat.completion) or "completions"
    tool_calls: bool = False  # chat: the output's <tool_call> blocks are returned as message.tool_calls (tools.py)
    n: int | None = None  # choices returned; None: 1
    best_of: int | None = None  # choices generated, the n best returned (>= n); None: n

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {self.endpoint!r} is not one of {ENDPOINTS}")
        if self.num_returned < 1 or self.num_sequences < self.num_returned:
            raise ValueError(f"n={self.n}, best_of={self.best_of}: 1 <= n <= best_of is required")

    @property
    def num_returned(self) -> int:
        return self.n or 1

    @property
    def num_sequences(self) -> int:
        """Sequences the engine generates: best_of, else n."""
        return self.best_of or self.num_returned

    @property
    def ranked(self) -> bool:
        """best_of > n: the n choices with the highest cumulative logprob are returned."""
        return self.num_sequences > self.num_returned

    def with_seed(self, seed: int) -> "RequestParams":
        return replace(self, sampling=replace(self.sampling, seed=seed))

    def sampling_params(self, max_tokens: int, tenant: str) -> SamplingParams:
        """The engine's parameters for this request (`tenant`: whom the engine's waiting queue serves in turn)."""
        s = self.sampling
        asked = {k: getattr(s, k) for k in _ENGINE_FIELDS if getattr(s, k) is not None}
        return SamplingParams(max_tokens=max_tokens, temperature=0.0 if s.temperature is None else s.temperature,
                              top_p=1.0 if s.top_p is None else s.top_p, seed=s.seed, stop=s.stop or (),
                              logprobs=s.logprobs, tenant=tenant, structured=s.structured, **asked)

    def to_dict(self) -> dict:
        """The stored form: `{"v": 1, "sampling": {the choices set}, "user"?, "endpoint"}`."""
        out = {"v": VERSION, "sampling": _set(self.sampling), "endpoint": self.endpoint}
        if self.user is not None:
            out["user"] = self.user
        if self.tool_calls:
            out["tool_calls"] = True
        out.update({k: getattr(self, k) for k in _CHOICES if getattr(self, k) is not None})
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "RequestParams":
        """The RequestParams of a stored form (versioned, or the legacy flat one); ParamsFormatError otherwise."""
        if not isinstance(data, dict):
            raise ParamsFormatError(f"stored request parameters are a JSON object, not {type(data).__name__}")
        if "v" not in data:  # flat: sampling keys beside user and endpoint
            sampling = {k: v for k, v in data.items() if k not in _IDENTITY}
            data = {"v": VERSION, "sampling": sampling, **{k: data[k] for k in _IDENTITY if k in data}}
        if data["v"] != VERSION:
            raise ParamsFormatError(f"request parameters version {data['v']!r} are unknown here (this process "
                                    f"reads version {VERSION}): a newer web process stored them; upgrade the workers")
        unknown = set(data) - {"v", "sampling", *_IDENTITY, *_SHAPE, *_CHOICES}
        try:
            if unknown:
                raise TypeError(f"unknown fields {sorted(unknown)}")
            if any(data.get(k) is not None and (not isinstance(data[k], int) or isinstance(data[k], bool))
                   for k in _CHOICES):
                raise TypeError("n and best_of are integers")
            return cls(Sampling(**data.get("sampling", {})), user=data.get("user"),
                       endpoint=data.get("endpoint", "chat"), tool_calls=data.get("tool_calls", False),
                       n=data.get("n"), best_of=data.get("best_of"))
        except (TypeError, ValueError) as exc:
            raise ParamsFormatError(f"malformed request parameters {data!r}: {exc}") from None

    def flat(self) -> dict:
        """One flat object of what the request set, as the request detail API shows it (and as requests were
        stored before RequestParams)."""
        out = _set(self.sampling)
        if self.user is not None:
            out["user"] = self.user
        if self.endpoint != "chat":
            out["endpoint"] = self.endpoint
        if self.tool_calls:
            out["tool_calls"] = True
        out.update({k: getattr(self, k) for k in _CHOICES if getattr(self, k) is not None})
        return out


def _set(sampling: Sampling) -> dict:
    """The choices a request set, JSON-ready."""
    return {k: _json(v) for k, v in asdict(sampling).items() if v is not None}


def _json(value):
    return [_json(v) for v in value] if isinstance(value, (tuple, list)) else value
