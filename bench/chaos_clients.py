"""The chaos suite's clients: streamed chat completions over HTTP (httpx) with a sentinel in every prompt,
what each client saw, and the scan of every response for sentinels planted by other requests."""
import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

SENTINEL_RE = re.compile(r"[A-Z][0-9][A-Z]-[A-Z][0-9][A-Z]-[A-Z][0-9][A-Z]")  # incidents.canary.prompts' shape
FILLER = "The dragon keeps a long and uneventful diary about the weather in the mountains. "
FINAL_STATUSES = ("done", "failed", "rejected")


def story_messages(sentinel: str, filler: int = 0) -> list[dict]:
    """A prompt the served model answers at length, repeating the sentinel (so a leak would show it)."""
    diary = f" Here is the diary: {FILLER * filler}" if filler else ""
    return [{"role": "user", "content": f"The secret code is {sentinel}. Tell a long story about a dragon who "
                                        f"guards the code {sentinel}.{diary}"}]


@dataclass
class Call:
    """One client request and everything its client saw."""

    tenant: str
    sentinel: str
    messages: list[dict]
    max_tokens: int
    disconnect_after: int = 0  # hang up after this many content deltas (0: read to the end)
    rid: str = ""
    submitted: float = 0.0
    http_status: int | None = None
    text: str = ""
    deltas: int = 0
    final: str = ""  # "done" or "error": the client got a final event or a final status
    code: str = ""
    ended: float | None = None  # when the client got it
    via: str = ""  # "stream" or "status" (polled GET /api/requests/<id> after the stream broke)
    disconnected_at: float | None = None
    broke: str = ""  # what cut the stream short, if anything
    errors: list[str] = field(default_factory=list)

    def finish(self, final: str, code: str = "", via: str = "stream") -> None:
        if not self.final:
            self.final, self.code, self.ended, self.via = final, code, time.time(), via


async def run_call(http: httpx.AsyncClient, url: str, key: str, call: Call, deadline: Callable[[], float | None]):
    """Streams the request; when the stream breaks before a final event, polls the request's status (as a
    client would) until it is final or `deadline()` (None: not known yet) passes. Cancellable at any point."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"messages": call.messages, "max_tokens": call.max_tokens, "stream": True, "temperature": 0}
    call.submitted = time.time()
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            call.http_status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    error = json.loads(raw)["error"]
                except (ValueError, KeyError, TypeError):
                    error = {"code": f"http_{resp.status_code}", "message": raw[:300].decode(errors="replace")}
                call.errors.append(str(error.get("message", "")))
                return call.finish("error", str(error.get("code") or f"http_{resp.status_code}"))
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    call.errors.append(str(event["error"].get("message", "")))
                    call.finish("error", str(event["error"].get("code") or "error"))
                    continue
                call.rid = call.rid or event.get("id", "")
                for choice in event.get("choices", []):
                    if content := (choice.get("delta") or {}).get("content"):
                        call.text += content
                        call.deltas += 1
                    if choice.get("finish_reason"):
                        call.finish("done")
                if call.disconnect_after and call.deltas >= call.disconnect_after and not call.final:
                    call.disconnected_at = time.time()
                    return  # leaving the block closes the connection mid-stream
            if not call.final:
                call.broke = "the stream ended without a final event"
    except (httpx.HTTPError, ValueError) as exc:
        call.broke = f"{type(exc).__name__}: {exc}"
    if call.final or not call.rid:
        return
    while (limit := deadline()) is None or time.time() < limit:
        try:
            r = await http.get(f"{url}/api/requests/{call.rid}", headers=headers)
            status = r.json() if r.status_code == 200 else {}
            if status.get("status") in FINAL_STATUSES:
                error = status.get("error") or {}
                return call.finish("done" if status["status"] == "done" else "error", error.get("code", ""), "status")
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.5)


def sightings(texts: list[str], own: set[str], planted: set[str]) -> list[str]:
    """Sentinels in `texts` that were planted by other requests (`planted` minus `own`). A sentinel is ~38
    random bits: the model cannot produce another request's by chance, only by reading its KV."""
    found = set()
    for text in texts:
        found.update(SENTINEL_RE.findall(text or ""))
    return sorted((found & planted) - own)
