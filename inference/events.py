"""A request's output events (Delta, Done, Error) and their one wire form: decode publishes them on the
request's stream (inference.streams), the API, the services and the canary read them back. A request's stream
ends with exactly one final event (Done or Error). A request of n choices (inference.choices) has one stream:
each Delta names its choice (`index`), and the one Done lists how every returned choice ended (`choices`).

Wire form: one JSON object, `{"v": 1, "type": "delta" | "done" | "error", ...fields}`, an unset optional
field left out. An object without `v` (written before events were versioned, same fields) reads as version 1;
an unknown version or type is refused (EventFormatError)."""
import json
from dataclasses import dataclass
from typing import ClassVar

VERSION = 1


class EventFormatError(ValueError):
    """Bytes on an output stream that are not an output event this process can read."""


@dataclass(frozen=True)
class Delta:
    """New text and, when the request asked for them, the log-probabilities of the token its step produced:
    `[[token id, logprob, [[id, logprob], ...]]]` (a token's text may come in a later delta). `tokens`: the
    completion tokens generated so far, this step's included (None from a writer that does not say)."""

    type: ClassVar[str] = "delta"
    text: str
    logprobs: list | None = None
    tokens: int | None = None  # the choice's completion tokens so far (continuous usage), when the worker counts
    index: int = 0  # the choice it belongs to (a wire form without it: choice 0)

    @classmethod
    def step(cls, text: str, token: int | None = None, logprobs=None, tokens: int | None = None,
             index: int = 0) -> "Delta":
        """The delta of one engine step; `logprobs` as the engine gives them: (logprob, [(id, logprob), ...])."""
        if logprobs is None:
            return cls(text, tokens=tokens, index=index)
        return cls(text, [[token, logprobs[0], [list(t) for t in logprobs[1]]]], tokens=tokens, index=index)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt, read from the prefix cache


@dataclass(frozen=True)
class ChoiceEnd:
    """How one choice ended: its generation index (its Deltas' `index`), finish reason, tokens and cumulative
    log-probability (of the model's own distribution; None when not computed)."""

    index: int
    finish_reason: str | None
    completion_tokens: int
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class Done:
    """The request ended. `usage` counts the prompt once and the returned choices' tokens; `choices` (a request
    of n choices only) the returned choices in answer order: best_of's best first, else by index."""

    type: ClassVar[str] = "done"
    finish_reason: str | None = None  # "stop" or "length" (of the first returned choice)
    usage: Usage | None = None
    choices: tuple[ChoiceEnd, ...] | None = None

    def __post_init__(self):
        if self.choices is not None:
            object.__setattr__(self, "choices", tuple(self.choices))


@dataclass(frozen=True)
class Error:
    """The request failed; `code` is what the client and the request's row show."""

    type: ClassVar[str] = "error"
    code: str
    message: str


OutputEvent = Delta | Done | Error
_TYPES = {cls.type: cls for cls in (Delta, Done, Error)}


def is_final(event: OutputEvent) -> bool:
    return isinstance(event, (Done, Error))


def event_encode(event: OutputEvent) -> str:
    """The wire form of an output event."""
    if type(event) not in _TYPES.values():
        raise EventFormatError(f"not an output event: {event!r}")
    fields = {"v": VERSION, "type": event.type}
    if isinstance(event, Delta):
        fields["text"] = event.text
        if event.logprobs is not None:
            fields["logprobs"] = event.logprobs
        if event.tokens is not None:
            fields["tokens"] = event.tokens
        if event.index:
            fields["index"] = event.index
    elif isinstance(event, Done):
        if event.finish_reason is not None:
            fields["finish_reason"] = event.finish_reason
        if event.usage is not None:
            fields["usage"] = {"prompt_tokens": event.usage.prompt_tokens,
                               "completion_tokens": event.usage.completion_tokens,
                               "cached_tokens": event.usage.cached_tokens}
        if event.choices is not None:
            fields["choices"] = [{"index": c.index, "finish_reason": c.finish_reason,
                                  "completion_tokens": c.completion_tokens,
                                  "cumulative_logprob": c.cumulative_logprob} for c in event.choices]
    else:
        fields.update(code=event.code, message=event.message)
    return json.dumps(fields, separators=(",", ":"))


def event_decode(raw: str | bytes) -> OutputEvent:
    """The output event of one wire form; EventFormatError for anything else."""
    try:
        fields = json.loads(raw)
    except ValueError as exc:
        raise EventFormatError(f"an output event is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise EventFormatError(f"an output event is a JSON object, not {type(fields).__name__}")
    version = fields.get("v", VERSION)
    if version != VERSION:
        raise EventFormatError(f"output event version {version!r} is unknown here (this process reads version "
                               f"{VERSION}): a newer worker wrote it; upgrade the readers first")
    kind = fields.get("type")
    if kind not in _TYPES:
        raise EventFormatError(f"unknown output event type {kind!r} (known: {sorted(_TYPES)})")
    try:
        if kind == "delta":
            tokens = fields.get("tokens")
            return Delta(str(fields["text"]), fields.get("logprobs"), None if tokens is None else int(tokens),
                         _index(fields.get("index", 0)))
        if kind == "done":
            usage, choices = fields.get("usage"), fields.get("choices")
            return Done(fields.get("finish_reason"), None if usage is None else Usage(
                int(usage["prompt_tokens"]), int(usage["completion_tokens"]), int(usage.get("cached_tokens", 0))),
                None if choices is None else tuple(ChoiceEnd(
                    _index(c["index"]), c.get("finish_reason"), int(c["completion_tokens"]),
                    None if c.get("cumulative_logprob") is None else float(c["cumulative_logprob"]))
                    for c in choices))
        return Error(str(fields["code"]), str(fields["message"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise EventFormatError(f"malformed {kind} event {fields!r}: {exc!r}") from None


def _index(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a choice index is an integer >= 0, not {value!r}")
    return value
