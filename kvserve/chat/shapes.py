"""What an answer looks like for each OpenAI endpoint: `chat.completion` (+ `.chunk`) for /v1/chat/completions,
`text_completion` for /v1/completions. kvserve/chat/outputs.py reads a request's events once, the same way for
both, and asks its shape to render them."""
import uuid
from dataclasses import dataclass, field

from inference.params import RequestParams
from inference.tools import ToolCallStream, parse_tool_calls
from kvserve.chat.logprobs import TokenText, chat_logprobs, completion_logprobs
from kvserve.chat.tokenizer import tokenizer_get


def _token_text() -> TokenText:
    return _TEXT.setdefault("served", TokenText(tokenizer_get()[0]))


_TEXT: dict[str, TokenText] = {}


@dataclass(frozen=True)
class ChatShape:
    logprobs: bool = False
    top_logprobs: int = 0
    object: str = "chat.completion"

    def _logprobs(self, entries):
        return chat_logprobs(entries, _token_text(), self.top_logprobs) if self.logprobs else None

    def answer(self, base: dict, text: str, finish_reason: str, entries: list, usage: dict) -> dict:
        return {**base, "object": self.object, "choices": [self.choice(0, text, finish_reason, entries)],
                "usage": usage}

    def choice(self, index: int, text: str, finish_reason: str, entries: list) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                "logprobs": self._logprobs(entries)}

    def chunk_object(self) -> str:
        return f"{self.object}.chunk"

    def opening(self, n: int = 1) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None, "logprobs": None} for i in range(n)]

    def delta(self, text: str, entries: list, offset: int, index: int = 0) -> dict:
        return {"index": index, "delta": {"content": text}, "finish_reason": None,
                "logprobs": self._logprobs(entries) if entries else None}

    def finish(self, finish_reason: str, index: int = 0) -> dict:
        return {"index": index, "delta": {}, "finish_reason": finish_reason, "logprobs": None}


@dataclass(frozen=True)
class TextShape:
    logprobs: int | None = None  # the legacy `logprobs`: alternatives per token, None for none
    object: str = "text_completion"

    def _logprobs(self, entries, offset: int = 0):
        if self.logprobs is None:
            return None
        return completion_logprobs(entries, _token_text(), self.logprobs, offset)

    def answer(self, base: dict, text: str, finish_reason: str, entries: list, usage: dict) -> dict:
        return {**base, "object": self.object, "choices": [self.choice(0, text, finish_reason, entries)],
                "usage": usage}

    def choice(self, index: int, text: str, finish_reason: str, entries: list) -> dict:
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": self._logprobs(entries)}

    def chunk_object(self) -> str:
        return self.object

    def opening(self, n: int = 1) -> list[dict]:
        return []

    def delta(self, text: str, entries: list, offset: int, index: int = 0) -> dict:
        return {"index": index, "text": text, "finish_reason": None,
                "logprobs": self._logprobs(entries, offset) if entries else None}

    def finish(self, finish_reason: str, index: int = 0) -> dict:
        return {"index": index, "text": "", "finish_reason": finish_reason, "logprobs": None}


def _call(call, index: int | None = None) -> dict:
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolChatShape(ChatShape):
    """A chat answer whose <tool_call> blocks (inference/tools.py) are OpenAI tool_calls: content null when there
    are only calls, finish_reason "tool_calls"; streamed, each call is one tool_calls delta once its closing tag
    arrives, and text that may still open one is held back. One instance per response (it keeps the stream's
    state)."""

    _stream: ToolCallStream = field(default_factory=ToolCallStream, compare=False, repr=False)
    _held_entries: list = field(default_factory=list, compare=False, repr=False)

    def answer(self, base: dict, text: str, finish_reason: str, entries: list, usage: dict) -> dict:
        out = super().answer(base, text, finish_reason, entries, usage)
        content, calls = parse_tool_calls(text)
        if calls:
            choice = out["choices"][0]
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": [_call(c) for c in calls]}
            if finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        return out

    def delta(self, text: str, entries: list, offset: int, index: int = 0) -> dict | None:
        before = self._stream.num_calls  # one choice only: n > 1 with tools is refused at the API
        content, calls = self._stream.push(text)
        self._held_entries.extend(entries)
        if not content and not calls:
            return None
        delta = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [_call(c, before + i) for i, c in enumerate(calls)]
        entries = list(self._held_entries)
        self._held_entries.clear()
        return {"index": 0, "delta": delta, "finish_reason": None,
                "logprobs": self._logprobs(entries) if entries else None}

    def finish(self, finish_reason: str, index: int = 0) -> dict:
        out = super().finish("tool_calls" if finish_reason == "stop" and self._stream.num_calls else finish_reason,
                             index)
        held = self._stream.flush()  # an unfinished call or tag: content after all
        if held:
            out["delta"] = {"content": held}
        return out


CHAT = ChatShape()


def shape_for(params: RequestParams):
    """The shape a request was asked in (its params record the endpoint and logprobs choices)."""
    logprobs = params.sampling.logprobs
    if params.endpoint == "completions":
        return TextShape(logprobs=logprobs)
    shape = ToolChatShape if params.tool_calls else ChatShape
    return shape(logprobs=logprobs is not None, top_logprobs=logprobs or 0)
