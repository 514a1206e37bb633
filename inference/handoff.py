"""The prefill→decode handoff: a typed, HMAC-signed message with an explicit verdict and the
expected and transferred token counts. Decode accepts only a valid OK whose counts, checksums,
model and page geometry match; everything else is refused (fails closed)."""
import enum
import hashlib
import hmac
import json
import time
from dataclasses import asdict, dataclass, field, replace


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
    first_token: int | None = None
    first_logprobs: list | None = None  # the first token's (logprob, [[id, logprob], ...]) when the request asked
    cached_tokens: int = 0  # prompt tokens prefill read from its prefix cache (usage; the blob holds them all)
    created_at: float = field(default_factory=time.time)
    signature: str = ""

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


def verify_for_decode(h: Handoff, key: bytes, *, fingerprint: str, page_size: int, dtype: str,
                      check: bool = True) -> None:
    """Raises HandoffRefused unless decode may proceed. `check=False` only under fault injection."""
    if not check:
        return
    if not h.has_valid_signature(key):
        raise HandoffRefused("handoff_forged", "signature does not verify with this deployment's handoff key")
    if h.verdict is not Verdict.OK:
        raise HandoffRefused("rejected", f"prefill verdict {h.verdict.value}: {h.reason}")
    if h.transferred_tokens != h.expected_tokens:
        raise HandoffRefused("handoff_mismatch",
                             f"transferred {h.transferred_tokens} tokens, expected {h.expected_tokens}")
    if h.model_fingerprint != fingerprint:
        raise HandoffRefused("handoff_mismatch", f"KV from model {h.model_fingerprint}, decode serves {fingerprint}")
    if h.page_size != page_size or h.dtype != dtype:
        raise HandoffRefused("handoff_mismatch", f"page size/dtype {h.page_size}/{h.dtype}, decode uses {page_size}/{dtype}")
    pages = -(-h.expected_tokens // page_size)
    if h.num_pages != pages or len(h.page_checksums) != pages or len(h.page_epochs) != pages:
        raise HandoffRefused("handoff_mismatch", f"{h.num_pages} pages / {len(h.page_checksums)} checksums for "
                                                 f"{h.expected_tokens} tokens (need {pages})")
