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
