"""inference.sampling on synthetic logits: each knob's effect, the batched sampler against a per-row reference
written the plain way (a loop over rows, a full sort, noise for every token), and the draw's independence of the
batch it runs in."""
import math
import random
from collections import Counter

import pytest
import torch

from inference.sampling import log_exp_noise, process_logits, row_key, row_uniform, sample
from inference.sequence import SamplingParams

V = 300
EOS = (2,)


def params(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 64)
    return SamplingParams(**kw)


def logits_of(n, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * scale


def reference(logits, params_list, steps, prompts, outputs, eos_ids=EOS):
    """One row at a time, each stage as its definition reads."""
    out = []
    for row, p, step, prompt, output in zip(logits, params_list, steps, prompts, outputs):
        x = row.double().clone()
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t, n in Counter(output).items():
            x[t] -= p.frequency_penalty * n + p.presence_penalty
        for t, b in p.logit_bias:
            x[t] += b
        if step < p.min_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
                x[t] = float("-inf")
        if p.is_greedy:
            out.append(int(x.argmax()))
            continue
        x = x / p.temperature
        order = x.argsort(descending=True)
        keep = torch.ones(V, dtype=torch.bool)
        if p.top_k:
            keep &= x >= x[order[p.top_k - 1]]
        if p.top_p < 1:
            kept = x.masked_fill(~keep, float("-inf"))
            probs = torch.softmax(kept, dim=0)[order]
            run = int(((probs.cumsum(0) - probs) < p.top_p).sum().clamp(min=1))
            keep &= x >= x[order[run - 1]]
        if p.min_p:
            keep &= torch.softmax(x, 0) >= p.min_p * torch.softmax(x, 0).max()
        if keep.sum() <= 256:  # the exponential race over the kept tokens
            key = torch.tensor([row_key(p.seed, step)])
            score = x - log_exp_noise(key, torch.arange(V).unsqueeze(0))[0]
            out.append(int(score.masked_fill(~keep, float("-inf")).argmax()))
        else:  # inverse CDF in token id order
            probs = torch.exp(x - x.max()).masked_fill(~keep, 0.0)
            cdf = probs.cumsum(0)
            out.append(int((cdf < row_uniform(p.seed, step) * cdf[-1]).sum()))
    return out


KNOBS = [dict(), dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.8),
         dict(temperature=0.9, min_p=0.1), dict(repetition_penalty=1.5), dict(frequency_penalty=1.2),
         dict(presence_penalty=-1.5, temperature=0.5), dict(logit_bias=((7, 30.0), (9, -100.0))),
         dict(min_tokens=10, stop_token_ids=(4, 5)), dict(top_k=1, temperature=1.5),
         dict(temperature=1.1, top_k=40, top_p=0.9, min_p=0.02, frequency_penalty=0.5, presence_penalty=0.4,
              repetition_penalty=1.2, logit_bias=((3, 2.0),), min_tokens=3, stop_token_ids=(11,))]


def batch(n, seed=0):
    rng = random.Random(seed)
    ps = [params(seed=rng.randrange(-2**63, 2**63), **KNOBS[i % len(KNOBS)]) for i in range(n)]
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 40))] for _ in range(n)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 30))] for _ in range(n)]
    steps = [len(o) for o in outputs]
    return ps, steps, prompts, outputs


@pytest.mark.parametrize("seed", range(6))
def test_the_batched_sampler_draws_what_the_per_row_reference_draws(seed):
    ps, steps, prompts, outputs = batch(len(KNOBS) * 2, seed)
    logits = logits_of(len(ps), seed)
    assert sample(logits, ps, steps, prompts, outputs, EOS) == reference(logits, ps, steps, prompts, outputs)


def test_a_rows_draw_does_not_depend_on_the_batch_it_is_in():
    ps, steps, prompts, outputs = batch(24, seed=9)
    logits = logits_of(24, seed=9)
    together = sample(logits, ps, steps, prompts, outputs, EOS)
    alone = [sample(logits[i:i + 1], ps[i:i + 1], steps[i:i + 1], prompts[i:i + 1], outputs[i:i + 1], EOS)[0]
             for i in range(24)]
    order = list(range(24))[::-1]
    shuffled = sample(logits[order], [ps[i] for i in order], [steps[i] for i in order], [prompts[i] for i in order],
                      [outputs[i] for i in order], EOS)
    assert together == alone == shuffled[::-1]


def test_the_same_seed_and_step_draw_the_same_token_and_another_step_another_stream():
    logits = logits_of(1, scale=0.5)  # flat: many tokens are likely
    p = params(temperature=1.0, seed=42)
    draws = [sample(logits, [p], [s])[0] for s in range(40)]
    assert draws == [sample(logits, [p], [s])[0] for s in range(40)]
    assert len(set(draws)) > 20
    assert [sample(logits, [params(temperature=1.0, seed=43)], [s])[0] for s in range(40)] != draws


def test_the_draw_follows_the_tempered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0] + [-30.0] * (V - 4)])
    n = 4000
    counts = Counter(sample(logits, [params(temperature=1.0, seed=s)], [0])[0] for s in range(n))
    expected = torch.softmax(logits[0], 0)[:4] * n
    for t in range(4):
        assert abs(counts[t] - expected[t].item()) < 4 * math.sqrt(expected[t].item()) + 5
    hot = Counter(sample(logits, [params(temperature=2.0, seed=s)], [0])[0] for s in range(n))
    assert hot[3] > counts[3] and hot[2] < counts[2]


def test_top_k_top_p_and_min_p_keep_only_what_they_allow():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0] + [-20.0] * (V - 5)])
    def drawn(**kw):
        return {sample(logits, [params(temperature=3.0, seed=s, **kw)], [0])[0] for s in range(300)}
    assert drawn(top_k=3) == {0, 1, 2}
    p = torch.softmax(logits[0] / 3.0, 0)
    run = int((p.cumsum(0) - p < 0.6).sum())
    assert drawn(top_p=0.6) == set(range(run)) and 1 < run < 5
    floor = p.max() * 0.6
    assert drawn(min_p=0.6) == {t for t in range(V) if p[t] >= floor} == {0, 1}
    assert drawn(min_p=1.0) == {0}


def test_greedy_takes_the_argmax_of_the_processed_logits():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5] + [-5.0] * (V - 4)])
    assert sample(logits, [params()], [0]) == [0]
    assert sample(logits, [params(top_k=1, temperature=1.5, seed=3)], [0]) == [0]
    assert sample(logits, [params(logit_bias=((0, -100.0),))], [0]) == [1]
    assert sample(logits, [params(logit_bias=((200, 100.0),))], [0]) == [200]
    assert sample(logits, [params(repetition_penalty=1.1)], [0], prompts=[[0]]) == [1]  # 3 / 1.1 < 2.9
    assert sample(logits, [params(frequency_penalty=0.1)], [2], outputs=[[0, 0]]) == [1]
    assert sample(logits, [params(presence_penalty=0.2)], [2], outputs=[[0, 0]]) == [1]
    assert sample(logits, [params(presence_penalty=0.2)], [1], outputs=[[1]]) == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0] + [0.0] * (V - 3)])
    x = process_logits(logits, [params(repetition_penalty=2.0)], [1], prompts=[[0]], outputs=[[1]])
    assert x[0, :3].tolist() == [1.0, -4.0, 1.0] and logits[0, 0] == 2.0  # the caller's logits untouched


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, V)
    x = process_logits(logits, [params(frequency_penalty=0.5, presence_penalty=0.25)], [3],
                       prompts=[[9]], outputs=[[4, 4, 6]])
    assert x[0, 4].item() == -1.25 and x[0, 6].item() == -0.75 and x[0, 9].item() == 0.0


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 2], logits[0, 8], logits[0, 5] = 9.0, 8.0, 7.0
    p = params(min_tokens=2, stop_token_ids=(8,))
    assert [sample(logits, [p], [s], eos_ids=EOS)[0] for s in range(3)] == [5, 5, 2]
    assert sample(logits, [params(min_tokens=2, ignore_eos=True)], [0], eos_ids=EOS) == [2]  # eos is not a stop


def test_a_batch_of_greedy_rows_is_the_argmax_and_is_left_alone():
    logits = logits_of(5)
    assert sample(logits, [params()] * 5, [0] * 5) == logits.argmax(-1).tolist()
    assert process_logits(logits, [params()] * 5, [0] * 5) is logits  # no stage ran: nothing copied


def test_a_flat_distribution_with_top_p_looks_past_the_first_candidates():
    logits = torch.zeros(1, 2000)
    logits[0, 1999] = 0.1
    p = params(temperature=1.0, top_p=0.99, seed=1)
    drawn = {sample(logits, [params(temperature=1.0, top_p=0.99, seed=s)], [0])[0] for s in range(200)}
    assert max(drawn) > 1000 and sample(logits, [p], [0]) == sample(logits, [p], [0])


def test_min_tokens_never_leaves_a_row_nothing_to_draw():
    """A grammar that may only end (every other token -inf) under min_tokens: the end stays drawable."""
    logits = torch.full((2, 8), float("-inf"))
    logits[0, 7] = 0.0  # row 0: only EOS (7) is allowed
    logits[1] = torch.arange(8.0)  # row 1: EOS is the argmax, and is held back
    params = [SamplingParams(min_tokens=5), SamplingParams(min_tokens=5)]
    assert sample(logits, params, [0, 0], eos_ids=(7,)) == [7, 6]
