"""The prefill stage's pieces, shared by the worker and the sandbox replay: the REJECTED/ABORTED handoff of a
prompt that is not prefilled (nothing taken or sent, never a placeholder; admission itself is the engine's
`add_request`), what a finished prefill exports, and the OK handoff built from it (blob shape/dtype signed)."""
from dataclasses import dataclass

import torch

from inference.handoff import Handoff, Verdict, blob_metadata, handoff_refusal
from inference.sequence import Sequence


@dataclass(frozen=True)
class Exported:
    """A finished prefill's KV, on its way from the engine loop to the task thread (crosses threads)."""

    first_token: int
    blob: torch.Tensor
    checksums: tuple[str, ...]
    epochs: tuple[int, ...]
    first_logprobs: tuple | None = None
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (the blob holds them all)
    choice_tokens: tuple[int, ...] = ()  # n > 1 choices: every choice's first token
    choice_logprobs: tuple | None = None  # and their (logprob, top), when computed


def _fields(engine, request_id: str, prompt_tokens: int, worker_id: str) -> dict:
    return dict(request_id=request_id, expected_tokens=prompt_tokens, model_fingerprint=engine.fingerprint,
                page_size=engine.page_size, dtype=engine.kv_dtype, prefill_worker=worker_id)


def prefill_refusal(engine, request_id: str, prompt_ids: list[int], worker_id: str, verdict: Verdict,
                    reason: str) -> Handoff:
    """A handoff of this engine that sends nothing (unsigned)."""
    return handoff_refusal(verdict, reason, **_fields(engine, request_id, len(prompt_ids), worker_id))


def prefill_export(engine, seq: Sequence, first_logprobs=None) -> Exported:
    """Exports a prefilled sequence's pages and releases them (freed and scrubbed by policy)."""
    blob, sums = engine.export_kv(seq)
    lps = tuple(seq.choice_logprobs) if any(lp is not None for lp in seq.choice_logprobs) else None
    exported = Exported(seq.output_ids[0], blob, tuple(sums), tuple(seq.page_epochs[: blob.shape[0]]), first_logprobs,
                        seq.cached_tokens, tuple(seq.choice_tokens), lps)
    engine.release(seq)
    return exported


def prefill_handoff(engine, request_id: str, prompt_ids: list[int], worker_id: str, exported: Exported, *,
                    verdict: Verdict = Verdict.OK, reason: str = "", transferred: int | None = None) -> Handoff:
    """The handoff (unsigned) that goes with `exported`: OK with every prompt token transferred."""
    return Handoff(verdict=verdict, reason=reason,
                   transferred_tokens=len(prompt_ids) if transferred is None else transferred,
                   num_pages=exported.blob.shape[0], page_checksums=exported.checksums, page_epochs=exported.epochs,
                   first_token=exported.first_token, first_logprobs=exported.first_logprobs,
                   cached_tokens=exported.cached_tokens, choice_tokens=exported.choice_tokens,
                   choice_logprobs=None if exported.choice_logprobs is None else
                   [None if lp is None else [lp[0], [list(t) for t in lp[1]]] for lp in exported.choice_logprobs],
                   **blob_metadata(exported.blob), **_fields(engine, request_id, len(prompt_ids), worker_id))
