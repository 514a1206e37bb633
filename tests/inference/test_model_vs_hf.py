"""The engine against Hugging Face transformers loading the same GGUF file (both dequantize to fp32).

Tolerance: both sides compute the same fp32 graph with different op order and fused kernels, so
logits differ by float rounding only. Over 30 layers that stays far below 1e-3 absolute on logits
of magnitude ~20 (measured max ~1e-4); 2e-3 leaves room for other BLAS builds and still catches
any real error (a wrong RoPE, norm or head mapping moves logits by whole units).
"""
import pytest
import torch

from inference.loader import resolve_model_path
from tests.inference.helpers import greedy, make_engine

pytestmark = pytest.mark.timeout(900)  # loading transformers' GGUF path alone takes ~30 s on 2 busy cores

PROMPTS = ["What is the capital of France?", "Write one sentence about the ocean.",
           "Count from one to five, then explain why counting matters in a long sentence."]


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = resolve_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def our_prompt_logits(model, ids):
    engine = make_engine(model)
    seq = engine.add_request("p", ids, greedy(1))
    (chunk,) = engine.scheduler.schedule()
    inp, pos, batch, _ = engine._prepare([chunk])
    engine.block_manager.check_reads(seq, 0, len(ids))
    hidden = engine.model.forward(inp, pos, batch, engine.pool)
    return engine.model.logits(hidden)


@pytest.mark.parametrize("text", PROMPTS)
def test_prompt_logits_match_transformers(real_model, hf_model, text):
    ids = real_model.tokenizer.encode_chat([{"role": "user", "content": text}])
    ours = our_prompt_logits(real_model, ids)
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit diff| {diff:.2e}")
    assert diff < 2e-3


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_tokens_match_transformers_for_32_steps(real_model, hf_model, text):
    ids = real_model.tokenizer.encode_chat([{"role": "user", "content": text}])
    (seq,) = make_engine(real_model).generate([ids], greedy(32))
    hf_ids = []
    with torch.inference_mode():  # plain greedy with transformers' own KV cache, EOS not special-cased
        out = hf_model(torch.tensor([ids]), use_cache=True)
        for _ in range(32):
            hf_ids.append(int(out.logits[0, -1].argmax()))
            out = hf_model(torch.tensor([[hf_ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    assert seq.output_ids == hf_ids
