"""inference.sampling.sampled_logprobs and the engine carrying them on its step events: the sampled token's
log-probability and the top alternatives under the model's own log-softmax, only for requests that ask."""
import pytest
import torch

from inference.engine import Engine, EngineConfig
from inference.sampling import sampled_logprobs
from inference.sequence import SamplingParams


def test_rows_that_ask_get_the_log_softmax_of_their_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    out = sampled_logprobs(logits, [7, 3, 11], [2, None, 0])
    ref = torch.log_softmax(logits, dim=-1)
    lp, top = out[0]
    assert lp == pytest.approx(ref[0, 7].item(), abs=1e-6)
    values, ids = ref[0].topk(2)
    assert [i for i, _ in top] == ids.tolist() and [x for _, x in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out[1] is None
    assert out[2][0] == pytest.approx(ref[2, 11].item(), abs=1e-6) and out[2][1] == ()
    assert sampled_logprobs(logits, [1, 2, 3], [None] * 3) == [None] * 3


def test_the_engine_reports_logprobs_of_the_tokens_it_samples(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_pages=32, page_size=16))
    asked = engine.add_request("a", list(range(1, 12)), SamplingParams(max_tokens=3, temperature=0.9, seed=5,
                                                                        logprobs=4, ignore_eos=True))
    engine.add_request("b", list(range(1, 9)), SamplingParams(max_tokens=3, ignore_eos=True))
    events = []
    while engine.has_work:
        events += engine.step()
    mine = [e for e in events if e.seq is asked]
    assert [e.token for e in mine] == asked.output_ids and all(len(e.logprobs[1]) == 4 for e in mine)
    assert all(e.logprobs is None for e in events if e.seq is not asked)
    assert all(e.logprobs[1][0][1] >= e.logprobs[0] for e in mine)  # the top alternative is at least as likely
    assert all(e.logprobs[0] <= 0 for e in mine)
