"""Per-request sampling: greedy, temperature, top-k, top-p, seeded so that any worker draws the
same token for the same (seed, step)."""
import torch

_MIX = 0x9E3779B97F4A7C15


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step * _MIX) & 0x7FFF_FFFF_FFFF_FFFF)


def sample(logits: torch.Tensor, params_list, steps: list[int]) -> list[int]:
    """logits [N, vocab] float32; one token per row."""
    out = logits.argmax(dim=-1).tolist()
    for i, params in enumerate(params_list):
        if params.is_greedy:
            continue
        row = logits[i].double() / params.temperature  # float64: tiny temperatures must not overflow to inf
        if params.top_k:
            kth = torch.topk(row, min(params.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < params.top_p
            keep[0] = True  # the most likely token always survives, whatever top_p underflows to
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        out[i] = int(torch.multinomial(probs, 1, generator=_generator(params.seed, steps[i])).item())
    return out


MAX_TOP_LOGPROBS = 20


def sampled_logprobs(logits: torch.Tensor, tokens: list[int], top_ns: list[int | None]) -> list[tuple | None]:
    """Per row, for rows that asked (top_n not None): (token's log-probability, ((id, logprob) of the top_n most
    likely tokens)), both under the model's own distribution, log_softmax of the raw logits (before temperature
    or top-p), as OpenAI's logprobs. None for rows that did not ask."""
    out: list[tuple | None] = [None] * len(tokens)
    rows = [i for i, n in enumerate(top_ns) if n is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    k = min(max(top_ns[i] for i in rows), MAX_TOP_LOGPROBS, lp.shape[-1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device)).squeeze(1).tolist()
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = min(top_ns[i], k)
        out[i] = (chosen[j], tuple(zip(top_ids[j][:n], top_lp[j][:n])))
    return out
