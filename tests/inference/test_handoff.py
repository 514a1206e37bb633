"""The one acceptance rule for a prefill→decode handoff (inference.handoff.handoff_accept), with a real blob
through LocalTransport: each check refuses on its own, and none pulls or trusts KV it should not."""
import dataclasses

import pytest
import torch

from inference.handoff import (KV_DTYPES, DecodeSide, Handoff, HandoffRefused, Verdict, blob_metadata, handoff_accept,
                               handoff_refusal)
from inference.kv_cache import page_checksums
from inference.transport import LocalTransport

KEY = b"h" * 32
PAGE = (2, 2, 16, 1, 4)  # layers, K/V, page_size, kv_heads, head_dim
PROMPT = 40  # tokens: 3 pages of 16


def blob_for(seed: int, dtype=torch.float32, pages: int = 3) -> torch.Tensor:
    return torch.randn(pages, *PAGE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def handoff_for(rid: str, blob: torch.Tensor, **changes) -> Handoff:
    h = Handoff(request_id=rid, verdict=Verdict.OK, reason="", expected_tokens=PROMPT, transferred_tokens=PROMPT,
                num_pages=blob.shape[0], page_checksums=tuple(page_checksums(blob)), page_epochs=(7, 8, 9),
                model_fingerprint="fp", page_size=16, dtype="float32", prefill_worker="prefill-1", first_token=3,
                blob_shape=tuple(blob.shape), blob_dtype=str(blob.dtype).removeprefix("torch."))
    return dataclasses.replace(h, **changes).signed(KEY)


def side(rid: str = "r", prompt: int = PROMPT) -> DecodeSide:
    return DecodeSide(rid, prompt, "fp", 16, "float32", page_shape=PAGE)


def sent(rid: str = "r", seed: int = 1, **changes):
    transport, blob = LocalTransport(), blob_for(seed)
    h = handoff_for(rid, blob, **changes)
    transport.send(h, blob)
    return transport, h, blob


def refused(message, transport, s=None, **kw) -> HandoffRefused:
    with pytest.raises(HandoffRefused) as err:
        handoff_accept(message, KEY, s or side(), transport.take, **kw)
    return err.value


def test_a_valid_handoff_is_accepted_once_with_its_exact_blob():
    transport, h, blob = sent()
    got_h, got = handoff_accept(h.to_dict(), KEY, side(), transport.take)
    assert got_h == h and torch.equal(got, blob) and got.dtype == torch.float32
    assert refused(h.to_dict(), transport).kind == "kv_missing"  # pulled once


def test_a_valid_handoff_of_another_request_is_refused_before_its_kv_is_pulled():
    transport, h, _ = sent("other")
    err = refused(h.to_dict(), transport, side("r"))
    assert err.kind == "handoff_mismatch" and "other" in err.reason
    assert transport.take("other") is not None  # the other request's KV was never touched


def test_a_prompt_length_other_than_the_tasks_is_refused():
    transport, h, _ = sent()
    assert refused(h, transport, side(prompt=PROMPT + 1)).kind == "handoff_mismatch"


def test_the_blob_shape_and_dtype_are_signed():
    transport, h, _ = sent()
    forged = dataclasses.replace(h, blob_shape=(3, 2, 2, 16, 1, 8))  # not signed again
    assert refused(forged, transport).kind == "handoff_forged"


@pytest.mark.parametrize("change", [
    {"blob_dtype": "float64"},  # signed, consistent with the stored blob, but not whitelisted
    {"blob_dtype": "uint8"},
    {"blob_dtype": ""},
])
def test_only_whitelisted_dtypes_are_accepted(change):
    transport, blob = LocalTransport(), blob_for(1, torch.float64)
    h = handoff_for("r", blob, **change)
    transport.send(h, blob)
    assert "float64" not in KV_DTYPES
    err = refused(h, transport)
    assert err.kind == "handoff_mismatch" and "dtype" in err.reason


def test_a_non_whitelisted_blob_is_refused_even_with_the_contract_off():
    transport, blob = LocalTransport(), blob_for(1, torch.float64)
    h = handoff_for("r", blob)
    transport.send(h, blob)
    assert refused(h, transport, check=False).kind == "handoff_mismatch"


def test_a_signed_shape_that_is_not_this_engines_page_geometry_is_refused():
    transport, blob = LocalTransport(), torch.randn(3, 2, 2, 16, 1, 8)
    h = handoff_for("r", blob)
    transport.send(h, blob)
    err = refused(h, transport)
    assert err.kind == "handoff_mismatch" and "shape" in err.reason


@pytest.mark.parametrize("meta", [
    {"dtype": "float16"},  # the stored blob relabelled: its bytes read as another dtype
    {"shape": [3, 2, 2, 16, 2, 2]},  # same bytes, another shape
    {"dtype": "float64", "shape": [3, 2, 2, 16, 1, 2]},  # not whitelisted
])
def test_a_stored_blob_whose_metadata_is_not_the_signed_one_is_refused_even_with_the_contract_off(meta):
    transport, h, _ = sent()
    stored = transport._kv["r"]
    transport._kv["r"] = dataclasses.replace(stored, meta={**stored.meta, **meta})
    err = refused(h, transport, check=False)
    assert err.kind == "handoff_mismatch" and "signed handoff says float32" in err.reason


def test_a_blob_of_the_wrong_byte_length_is_refused():
    transport, h, _ = sent()
    stored = transport._kv["r"]
    transport._kv["r"] = dataclasses.replace(stored, raw=stored.raw[:-4])
    assert "bytes" in refused(h, transport, check=False).reason


def test_a_blob_swapped_for_another_requests_is_refused_by_its_checksums():
    transport, h, _ = sent("r", seed=1)
    transport.send(h, blob_for(2))  # another request's KV under r's key, same shape and epochs
    assert refused(h, transport, check=False).kind == "handoff_mismatch"


def test_kv_stored_under_other_epochs_is_refused_by_the_fence():
    transport, h, blob = sent()
    transport.send(dataclasses.replace(h, page_epochs=(7, 8, 10)), blob)  # a later grant of page 3
    assert refused(h, transport, check=False).kind == "stale_epoch"


@pytest.mark.parametrize("changes, kind", [
    ({"verdict": Verdict.REJECTED, "reason": "too long"}, "rejected"),
    ({"transferred_tokens": 1}, "handoff_mismatch"),
    ({"model_fingerprint": "other"}, "handoff_mismatch"),
    ({"num_pages": 2}, "handoff_mismatch"),
])
def test_verdict_counts_model_and_pages_are_checked_before_the_kv_is_pulled(changes, kind):
    transport, h, _ = sent()
    bad = dataclasses.replace(h, **changes).signed(KEY)
    assert refused(bad, transport).kind == kind
    assert transport.take("r") is not None


def test_a_decode_worker_in_another_precision_refuses_the_kv_before_pulling_it():
    from inference.precision import precision_fingerprint

    transport, h, _ = sent(model_fingerprint=precision_fingerprint("fp", "fp32"))
    bf16_decode = dataclasses.replace(side(), fingerprint=precision_fingerprint("fp", "bf16"))
    err = refused(h, transport, bf16_decode)
    assert err.kind == "handoff_mismatch" and "fp+bf16" in err.reason
    assert transport.take("r") is not None  # refused before its KV was pulled
    transport, h, blob = sent(model_fingerprint=precision_fingerprint("fp", "bf16"))
    assert torch.equal(handoff_accept(h, KEY, bf16_decode, transport.take)[1], blob)  # same precision: accepted


def test_a_signature_with_another_key_is_forged():
    transport, h, _ = sent()
    assert refused(h.signed(b"x" * 32), transport).kind == "handoff_forged"


def test_only_whitelisted_blobs_get_signed_metadata():
    assert blob_metadata(blob_for(1, torch.bfloat16)) == {"blob_shape": (3, *PAGE), "blob_dtype": "bfloat16"}
    assert blob_metadata(blob_for(1, torch.int8)) == {"blob_shape": (3, *PAGE), "blob_dtype": "int8"}
    with pytest.raises(ValueError):
        blob_metadata(blob_for(1, torch.float64))


def test_a_refusal_handoff_carries_no_kv_and_is_never_ok():
    h = handoff_refusal(Verdict.REJECTED, "does not fit", request_id="r", expected_tokens=PROMPT,
                        model_fingerprint="fp", page_size=16, dtype="float32", prefill_worker="p")
    assert (h.transferred_tokens, h.num_pages, h.page_checksums, h.blob_shape) == (0, 0, (), ())
    with pytest.raises(ValueError):
        handoff_refusal(Verdict.OK, "", request_id="r", expected_tokens=1, model_fingerprint="fp", page_size=16,
                        dtype="float32", prefill_worker="p")
    assert refused(h.signed(KEY), LocalTransport()).kind == "rejected"
