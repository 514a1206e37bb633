"""Chunked prefill against transformers on tiny random models: a prompt prefilled in many small
chunks (each continuing a cached prefix) must give the logits of one full forward, for a
multi-head model (kv heads == heads) as for grouped-query attention, with each attention backend."""
import pytest
import torch

from inference.engine import Engine, EngineConfig
from inference.loader import load_model
from tests.inference.helpers import greedy

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(61)]  # byte tokens; 61 = 8 chunks of 7 and a partial one


def chunked_prompt_logits(model, backend):
    engine = Engine(model, EngineConfig(num_pages=64, page_size=4, chunk_size=7, attention=backend))
    seq = engine.add_request("c", PROMPT, greedy(1))
    out = []
    while seq.num_cached < len(PROMPT):
        (chunk,) = engine.scheduler.schedule()
        engine.block_manager.check_reads(seq, seq.num_cached, chunk.num_tokens)
        inp, pos, batch, _ = engine._prepare([chunk])
        out.append(engine.model.logits(engine.model.forward(inp, pos, batch, engine.pool)))
        engine.block_manager.mark_written(seq, seq.num_cached + chunk.num_tokens)
        seq.num_cached += chunk.num_tokens
    assert len(out) == 9
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["hf_mha", "hf"])
@pytest.mark.parametrize("backend", ["native", "sdpa"])
def test_chunked_prefill_logits_match_transformers(tiny_paths, kind, backend):
    transformers = pytest.importorskip("transformers")
    ours_model = load_model(tiny_paths[kind])
    c = ours_model.config
    assert (c.num_kv_heads == c.num_heads) == (kind == "hf_mha")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_paths[kind]), dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    ours = chunked_prompt_logits(ours_model, backend)
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, f"max |logit diff| {diff:.2e}"
    # and the greedy continuation after a chunked prefill is transformers' greedy continuation
    (seq,) = Engine(ours_model, EngineConfig(num_pages=64, page_size=4, chunk_size=7, attention=backend)).generate(
        [PROMPT], greedy(8))
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert seq.output_ids == ref
