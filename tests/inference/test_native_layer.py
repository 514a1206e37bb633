"""A w4a8 decode step's layers in one native call (inference/native/layer.cpp) compute what the Python loop
of inference/model.py computes, bit for bit, and only where every row reads the pool."""
import pytest
import torch

from inference import native
from tests.inference.helpers import greedy, make_engine

pytestmark = pytest.mark.skipif(not native.fused_available(), reason="the native library is built by make install")
PROMPTS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?"]


@pytest.fixture
def codes_rows(real_model, monkeypatch):
    """Pins KVSERVE_W4A8_ROWS (auto would time it) for a fresh w4a8 Llama; yields a setter."""
    from inference.precision import w4a8_max_rows

    def pin(rows: int):
        monkeypatch.setenv("KVSERVE_W4A8_ROWS", str(rows))
        w4a8_max_rows.cache_clear()
        real_model.built.clear()

    yield pin
    w4a8_max_rows.cache_clear()
    real_model.built.clear()


def run(real_model, native_layers: bool, prompts=PROMPTS):
    """Greedy outputs of PROMPTS, the hidden states every logits call saw, and which forwards ran layer.cpp."""
    model = make_engine(real_model, precision="w4a8").model  # the process's shared w4a8 Llama
    saved = model._native_layers
    assert saved is not None
    hiddens, paths = [], []
    logits, native_step = model.logits, model._native_step
    model.logits = lambda hidden: (hiddens.append(hidden.clone()), logits(hidden))[1]
    model._native_step = lambda *args: (paths.append(native_step(*args)), paths[-1])[1]
    model._native_layers = saved if native_layers else None
    try:
        ids = [real_model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        outputs = [s.output_ids for s in make_engine(real_model, precision="w4a8").generate(ids, greedy(12))]
    finally:
        del model.logits, model._native_step
        model._native_layers = saved
    return outputs, hiddens, paths


def test_the_native_layer_is_the_python_loop_bit_for_bit(real_model, codes_rows):
    codes_rows(8)
    out_native, hid_native, paths = run(real_model, native_layers=True)
    out_python, hid_python, _ = run(real_model, native_layers=False)
    assert out_native == out_python
    assert len(hid_native) == len(hid_python) == 12
    assert all(torch.equal(a, b) for a, b in zip(hid_native, hid_python))
    # the prompts' prefill ran the Python loop (fresh chunks: no pool to read yet), every decode step layer.cpp
    assert paths[0] is False and len(paths) == 12 and all(paths[1:])


def test_a_prompt_within_the_codes_rows_is_still_prefilled_by_the_python_loop(real_model, codes_rows):
    """A fresh prompt has no pages to read yet (its attention is over its own K/V): never layer.cpp's paged path,
    however few its rows."""
    codes_rows(64)
    ids_len = len(real_model.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
    assert ids_len <= 64
    out_native, hid_native, paths = run(real_model, native_layers=True, prompts=["Hi"])
    out_python, hid_python, _ = run(real_model, native_layers=False, prompts=["Hi"])
    assert paths[0] is False and all(paths[1:])
    assert out_native == out_python and all(torch.equal(a, b) for a, b in zip(hid_native, hid_python))


def test_the_native_layer_is_off_where_it_does_not_apply(real_model, codes_rows):
    assert make_engine(real_model).model._native_layers is None  # fp32
    assert make_engine(real_model, precision="w4a8", attention="sdpa").model._native_layers is None
    codes_rows(2)
    _, _, paths = run(real_model, native_layers=True)
    assert not any(paths)  # three decode rows a step: above the codes' rows, the dense Python path


def test_decode_layers_refuses_a_wrong_weight_list():
    args = (torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(2, 1, 2, 4, 1, 4), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0, 1, 1, 1e-5)
    with pytest.raises(RuntimeError, match="14 weight tensors a layer"):
        torch.ops.kvserve_paged.decode_layers(torch.zeros(1, 8), [torch.zeros(1)] * 3, *args)
    with pytest.raises(RuntimeError, match="2 layers of weights for a pool of 1 layers"):
        torch.ops.kvserve_paged.decode_layers(torch.zeros(1, 8), [torch.zeros(1)] * 28, *args)
