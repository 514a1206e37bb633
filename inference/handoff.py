"""The prefill→decode handoff: a typed, HMAC-signed message with an explicit verdict, the expected and
transferred token counts and the transported blob's shape and dtype. Owns the one acceptance rule
(`handoff_accept`, called by the decode worker, the sandbox and the canary) and the one builder of a
handoff that carries no KV (`handoff_refusal`). Everything decode does not accept is refused (fails closed)."""
import enum
import hashlib
import hmac
import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from inference.kv_cache import cdiv, page_checksums

# the only dtypes a transported blob may carry (decoded with a fixed table, never getattr(torch, <input>))
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


class Verdict(str, enum.Enum):
    OK = "OK"
    REJECTED = "REJECTED"  # prefill refused the prompt (it cannot fit): no pages, no KV
    ABORTED = "ABORTED"  # cancelled before completion
    FAILED = "FAILED"  # prefill raised


@dataclass(frozen=True)
class Handoff:
    request_id: str
    verdict: Verdict
    reason: str
    expected_tokens: int  # the prompt's token count
    transferred_tokens: int  # tokens whose K/V were sent
    num_pages: int
    page_checksums: tuple[str, ...]
    page_epochs: tuple[int, ...]  # the prefill ledger epochs of the sent pages (fencing the KV blob)
    model_fingerprint: str
    page_size: int
    dtype: str
    prefill_worker: str
    blob_shape: tuple[int, ...] = ()  # the transported blob's shape [pages, layers, 2, page_size, kv_heads, head_dim]
    blob_dtype: str = ""  # the transported blob's dtype (one of KV_DTYPES); both signed with the rest
    first_token: int | None = None
    first_logprobs: list | None = None  # the first token's (logprob, [[id, logprob], ...]) when the request asked
    cached_tokens: int = 0  # prompt tokens prefill read from its prefix cache (usage; the blob holds them all)
    created_at: float = field(default_factory=time.time)
    signature: str = ""
    choice_tokens: tuple[int, ...] = ()  # a request of n > 1 choices: every choice's first token (choice 0's first)
    choice_logprobs: list | None = None  # and each one's (logprob, top) when computed; signed with the rest

    def payload(self) -> bytes:
        body = asdict(self)
        body.pop("signature")
        body["verdict"] = self.verdict.value
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, key: bytes) -> "Handoff":
        return replace(self, signature=hmac.new(key, self.payload(), hashlib.sha256).hexdigest())

    def has_valid_signature(self, key: bytes) -> bool:
        expected = hmac.new(key, self.payload(), hashlib.sha256).hexdigest()
        return hmac.compare_digest(expected, self.signature or "")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Handoff":
        d = dict(d)
        try:
            d["verdict"] = Verdict(d["verdict"])
            d["page_checksums"] = tuple(d["page_checksums"])
            d["page_epochs"] = tuple(d["page_epochs"])
            d["blob_shape"] = tuple(int(n) for n in d.get("blob_shape") or ())
            d["choice_tokens"] = tuple(int(t) for t in d.get("choice_tokens") or ())
            return cls(**d)
        except (KeyError, TypeError, ValueError) as exc:
            raise HandoffRefused("handoff_forged", f"malformed handoff: {exc}") from exc


class HandoffRefused(Exception):
    """Decode refuses a handoff. `kind` is the incident kind, or "rejected" for a plain verdict."""

    def __init__(self, kind: str, reason: str):
        self.kind = kind
        self.reason = reason
        super().__init__(f"{kind}: {reason}")

    @property
    def is_incident(self) -> bool:
        return self.kind != "rejected"


def handoff_refusal(verdict: Verdict, reason: str, *, request_id: str, expected_tokens: int, model_fingerprint: str,
                    page_size: int, dtype: str, prefill_worker: str) -> Handoff:
    """The one builder of a handoff that sends no KV (REJECTED, ABORTED, FAILED): nothing taken, nothing sent."""
    if verdict is Verdict.OK:
        raise ValueError("an OK handoff carries KV: build it from the exported pages")
    return Handoff(request_id=request_id, verdict=verdict, reason=reason, expected_tokens=expected_tokens,
                   transferred_tokens=0, num_pages=0, page_checksums=(), page_epochs=(),
                   model_fingerprint=model_fingerprint, page_size=page_size, dtype=dtype, prefill_worker=prefill_worker)


@dataclass(frozen=True)
class DecodeSide:
    """What the decode side expects of a handoff: the task's request, its prompt length, and its own engine's
    model, page geometry ([layers, 2, page_size, kv_heads, head_dim] per page) and dtype."""

    request_id: str
    prompt_tokens: int
    fingerprint: str
    page_size: int
    dtype: str
    page_shape: tuple[int, ...] | None = None  # None: not checked (a caller without an engine)
    choices: int = 1  # sequences the task generates (n, or best_of): a handoff carries that many first tokens


@dataclass(frozen=True)
class TransportedKV:
    """What a transport hands back for a request: the metadata stored with the blob, and its raw bytes."""

    meta: dict
    raw: bytes


def handoff_accept(message: "dict | Handoff", key: bytes, side: DecodeSide,
                   take: Callable[[str], "TransportedKV | None"], *, check: bool = True) -> tuple[Handoff, torch.Tensor]:
    """The one acceptance rule for a prefill→decode handoff; (handoff, blob) or HandoffRefused.

    Before any KV is pulled: signature, verdict, counts, the request-id and prompt-length binding, model,
    page geometry, dtype whitelist and the signed blob shape. Then `take(request_id)` pulls the KV once;
    it is accepted only when its stored epochs are the handoff's (the fence), its stored shape and dtype are
    the signed ones, its bytes are exactly that many, and every page checksum matches.
    `check=False` (fault `no_handoff_check` only) skips the contract; the blob's own checks always run."""
    h = message if isinstance(message, Handoff) else Handoff.from_dict(message)
    if check:
        _check_contract(h, key, side)
    _check_choices(h, side)
    kv = take(h.request_id)
    if kv is None:
        raise HandoffRefused("kv_missing", f"no KV for {h.request_id}: expired, already pulled, or never sent")
    return h, _blob_of(h, kv)


def _check_contract(h: Handoff, key: bytes, side: DecodeSide) -> None:
    if not h.has_valid_signature(key):
        raise HandoffRefused("handoff_forged", "signature does not verify with this deployment's handoff key")
    if h.verdict is not Verdict.OK:
        raise HandoffRefused("rejected", f"prefill verdict {h.verdict.value}: {h.reason}")
    if h.request_id != side.request_id or h.expected_tokens != side.prompt_tokens:
        raise HandoffRefused("handoff_mismatch", f"handoff is for {h.request_id} with {h.expected_tokens} tokens, "
                                                 f"the task for {side.request_id} with {side.prompt_tokens}")
    if h.transferred_tokens != h.expected_tokens:
        raise HandoffRefused("handoff_mismatch",
                             f"transferred {h.transferred_tokens} tokens, expected {h.expected_tokens}")
    if h.model_fingerprint != side.fingerprint:
        raise HandoffRefused("handoff_mismatch", f"KV from model {h.model_fingerprint}, decode serves {side.fingerprint}")
    if h.page_size != side.page_size or h.dtype != side.dtype:
        raise HandoffRefused("handoff_mismatch",
                             f"page size/dtype {h.page_size}/{h.dtype}, decode uses {side.page_size}/{side.dtype}")
    pages = cdiv(h.expected_tokens, side.page_size)
    if h.num_pages != pages or len(h.page_checksums) != pages or len(h.page_epochs) != pages:
        raise HandoffRefused("handoff_mismatch", f"{h.num_pages} pages / {len(h.page_checksums)} checksums for "
                                                 f"{h.expected_tokens} tokens (need {pages})")
    if h.blob_dtype not in KV_DTYPES:
        raise HandoffRefused("handoff_mismatch", f"blob dtype {h.blob_dtype!r} is not one of {sorted(KV_DTYPES)}")
    shape = tuple(h.blob_shape)
    if len(shape) != 6 or shape[0] != pages or shape[3] != side.page_size or \
            (side.page_shape is not None and shape[1:] != tuple(side.page_shape)):
        raise HandoffRefused("handoff_mismatch", f"blob shape {list(shape)} is not {pages} pages of "
                                                 f"{list(side.page_shape or ('?', 2, side.page_size, '?', '?'))}")


def _check_choices(h: Handoff, side: DecodeSide) -> None:
    """A task of n > 1 choices takes a handoff of exactly n first tokens (choice 0's the handoff's own), and one of
    a single choice a handoff of none: decode never forks more or fewer choices than were sampled for it."""
    want = side.choices if side.choices > 1 else 0
    lps = h.choice_logprobs
    if len(h.choice_tokens) != want or (want and h.choice_tokens[0] != h.first_token) or \
            (lps is not None and (not isinstance(lps, list) or len(lps) != want)):
        raise HandoffRefused("handoff_mismatch", f"the handoff carries {len(h.choice_tokens)} choices' first tokens, "
                                                 f"the task generates {side.choices} choice(s)")


def _blob_of(h: Handoff, kv: TransportedKV) -> torch.Tensor:
    meta = kv.meta
    if tuple(meta.get("epochs") or ()) != tuple(h.page_epochs):
        raise HandoffRefused("stale_epoch", f"KV epochs {meta.get('epochs')} do not match the handoff's "
                                            f"{list(h.page_epochs)}")
    dtype, shape = meta.get("dtype"), tuple(int(n) for n in meta.get("shape") or ())
    if dtype not in KV_DTYPES or dtype != h.blob_dtype or shape != tuple(h.blob_shape):
        raise HandoffRefused("handoff_mismatch", f"KV blob is {dtype} {list(shape)}, the signed handoff says "
                                                 f"{h.blob_dtype} {list(h.blob_shape)} (allowed: {sorted(KV_DTYPES)})")
    torch_dtype = KV_DTYPES[dtype]
    size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=torch_dtype).element_size() if shape else 0
    if not shape or len(kv.raw) != size:
        raise HandoffRefused("handoff_mismatch", f"KV blob has {len(kv.raw)} bytes, {list(shape)} {dtype} needs {size}")
    flat = torch.from_numpy(np.frombuffer(kv.raw, dtype=np.uint8).copy())
    blob = flat.view(torch_dtype).reshape(shape)
    if page_checksums(blob) != list(h.page_checksums):
        raise HandoffRefused("handoff_mismatch", "page checksums do not match the handoff")
    return blob


def blob_metadata(blob: torch.Tensor) -> dict:
    """The blob fields an OK handoff signs: its shape and (whitelisted) dtype."""
    dtype = str(blob.dtype).removeprefix("torch.")
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype {dtype} is not one of {sorted(KV_DTYPES)}")
    return {"blob_shape": tuple(int(n) for n in blob.shape), "blob_dtype": dtype}
