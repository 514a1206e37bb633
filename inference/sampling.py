"""Sampling for a whole batch in one pass of tensor ops: penalties, logit bias, min_tokens, then greedy or a
seeded draw through temperature, top-k, top-p and min-p; and the sampled tokens' log-probabilities.

The draw is counter-based, so that any worker, at any batch composition, draws the same token for the same
(seed, step): no generator state, only hashes of (seed, step) in int64 tensor ops. A row whose filters keep at
most _PREFIX tokens (any top_k <= 256, and most top_p / min_p) runs the exponential race over them: each kept
token t gets E_t = -log(u_t), u_t uniform from a 32-bit hash of (seed, step, t), and the row takes
argmax(log p_t - log E_t); argmax(p / E) with E ~ Exp(1) picks t with probability p_t, an exact draw (log p_t is
the tempered logit: the shared normalizer does not change an argmax). A row keeping more (plain temperature
sampling) draws by inverse CDF: one uniform from (seed, step), the first token in id order whose cumulative
probability reaches it, with no per-token hash over the vocabulary. Which of the two a row takes depends on that
row alone, so a row draws the same alone or in any batch."""
import math

import torch

from inference import native

_MIX = 0x9E3779B97F4A7C15
_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF


def _splitmix64(x: int) -> int:
    x = (x + _MIX) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, step: int) -> tuple[int, int]:
    """Two 32-bit words keying one row's draw at one step (Python ints: exact for any 64-bit seed)."""
    k = _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64))
    return k & _M32, k >> 32


def row_uniform(seed: int, step: int) -> float:
    """One uniform in (0, 1) for a row's (seed, step), 53 bits: the inverse-CDF draw's."""
    lo, hi = row_key(seed, step)
    return ((_splitmix64(hi << 32 | lo) >> 11) + 0.5) * 2.0**-53


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """x * m mod 2**32 for x in [0, 2**32): two 16-bit halves, so no int64 product overflows."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def log_exp_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log E for E ~ Exp(1), one per (row, token): `keys` [N, 2] int64 from row_key, `token_ids` [N, K] int64.
    float64, a function of (key, token id) alone."""
    h = _mix32(_mul32(token_ids & _M32, 0x9E3779B1) ^ keys[:, :1])
    h = _mix32(h ^ keys[:, 1:])
    u = (h.double() + 0.5) * 2.0**-32  # in (0, 1)
    return torch.log(-torch.log(u))


_PREFIX = 256  # a row keeping at most this many tokens races them, one keeping more draws by its CDF


def _flat(rows: list[list[int]], device):
    """(row index, token id) pairs of ragged token lists, as two int64 tensors."""
    r = [i for i, ids in enumerate(rows) for _ in ids]
    c = [t for ids in rows for t in ids]
    return torch.tensor(r, dtype=torch.long, device=device), torch.tensor(c, dtype=torch.long, device=device)


def _col(values, device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def process_logits(logits: torch.Tensor, params_list, steps: list[int], prompts=None, outputs=None,
                   eos_ids=()) -> torch.Tensor:
    """The logits every row samples from (greedy rows take their argmax), float32; a new tensor when a stage
    changed anything (the caller's logits are never written). Each stage runs only when some row uses it, and
    touches only the (row, token) pairs it concerns:
      repetition_penalty (vLLM): over the prompt and output tokens, a positive logit divided by it, a negative
        one multiplied;
      frequency_penalty, presence_penalty (OpenAI): over output tokens, logit -= freq * count + pres * (count > 0);
      logit_bias: added;
      min_tokens: while fewer outputs than it, EOS (unless ignore_eos) and stop_token_ids are -inf, unless
        nothing else is left to the row (a grammar that may only end)."""
    x = logits.float()
    device, vocab = x.device, x.shape[-1]
    outputs = outputs if outputs is not None else [[] for _ in params_list]
    prompts = prompts if prompts is not None else [[] for _ in params_list]
    copied = False

    def writable():
        nonlocal x, copied
        if not copied:
            x, copied = x.clone(), True
        return x

    rep = [p.repetition_penalty for p in params_list]
    if any(r != 1.0 for r in rep):
        r, c = _flat([set(pr) | set(out) if rp != 1.0 else () for pr, out, rp in zip(prompts, outputs, rep)], device)
        v = writable()[r, c]
        penalty = torch.tensor(rep, dtype=x.dtype, device=device)[r]
        x[r, c] = torch.where(v > 0, v / penalty, v * penalty)
    freq = [p.frequency_penalty for p in params_list]
    pres = [p.presence_penalty for p in params_list]
    if any(freq) or any(pres):
        r, c = _flat([out if f or q else () for out, f, q in zip(outputs, freq, pres)], device)
        if len(c):
            pairs, counts = torch.unique(r * vocab + c, return_counts=True)
            r, c = pairs // vocab, pairs % vocab
            f, q = (torch.tensor(a, dtype=x.dtype, device=device)[r] for a in (freq, pres))
            writable()[r, c] -= f * counts + q
    bias = [(i, t, b) for i, p in enumerate(params_list) for t, b in p.logit_bias if 0 <= t < vocab]
    if bias:
        r, c, b = zip(*bias)
        writable().index_put_((torch.tensor(r, device=device), torch.tensor(c, device=device)),
                              torch.tensor(b, dtype=x.dtype, device=device), accumulate=True)
    banned = [(i, t) for i, (p, step) in enumerate(zip(params_list, steps)) if step < p.min_tokens
              for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)) if 0 <= t < vocab]
    if banned:
        r, c = zip(*banned)
        r, c = torch.tensor(r, device=device), torch.tensor(c, device=device)
        held = x[r, c].clone()
        writable()[r, c] = float("-inf")
        # a row left no other token (a grammar that may only end here) keeps its end: never an all -inf row
        stuck = torch.isneginf(x[r]).all(dim=-1)
        if bool(stuck.any()):
            x[r[stuck], c[stuck]] = held[stuck]
    return x


def _race(vals: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The exponential race over each row's candidates (vals: tempered logits, -inf = dropped; ids: their token
    ids): argmax(v - log E(key, token)), a tie to the smallest token id."""
    score = vals.double() - log_exp_noise(keys, ids)
    best = score.max(dim=-1, keepdim=True).values
    return ids.masked_fill(score < best, torch.iinfo(torch.long).max).min(dim=-1).values


def _thresholds(x: torch.Tensor, ps, device) -> tuple[torch.Tensor, tuple]:
    """Per row, the smallest tempered logit its filters keep (top_k: the k-th largest; top_p: the last of the
    shortest leading run holding top_p of the mass after top_k; min_p: max + log(min_p)), and the sorted leading
    candidates (tempered values, ids) it looked at."""
    m, vocab = x.shape
    temp = _col([p.temperature for p in ps], device)
    top_k = [min(p.top_k, vocab) for p in ps]
    top_p = [p.top_p for p in ps]
    min_p = [p.min_p for p in ps]
    width = min(max([_PREFIX + 1, *top_k]), vocab)  # one past _PREFIX: sample() tells rows keeping more
    nucleus = _col([q < 1.0 for q in top_p], device, torch.bool)
    while True:
        vals, ids = x.topk(width, dim=-1)
        vals = vals / temp
        thr = torch.full((m, 1), float("-inf"), device=device)
        if any(top_k):
            kk = torch.tensor([k or width for k in top_k], device=device).unsqueeze(1)
            kth = vals.gather(1, kk - 1).masked_fill(_col([not k for k in top_k], device, torch.bool), float("-inf"))
            thr = torch.maximum(thr, kth)
        if any(q < 1.0 for q in top_p):
            kept = vals.masked_fill(vals < thr, float("-inf"))
            lse = torch.logsumexp(kept, dim=-1, keepdim=True)  # rows with a top_k: over the k it kept
            if not all(k for k, q in zip(top_k, top_p) if q < 1.0):  # the others: over the whole vocabulary
                lse = torch.where(thr > float("-inf"), lse, torch.logsumexp(x / temp, dim=-1, keepdim=True))
            probs = torch.exp(kept - lse)
            keep = probs.cumsum(dim=-1) - probs < _col(top_p, device)
            keep[:, 0] = True  # the most likely token always survives, whatever top_p underflows to
            n = keep.sum(dim=-1, keepdim=True)
            if width < vocab and not bool(((n < width) | ~nucleus).all()):
                width = vocab if width >= 4096 else min(width * 16, vocab)  # a flat distribution: look further
                continue
            thr = torch.where(nucleus, torch.maximum(thr, vals.gather(1, n - 1)), thr)
        if any(min_p):
            thr = torch.maximum(thr, vals[:, :1] + _col([math.log(q) if q else float("-inf") for q in min_p], device))
        return thr, (vals, ids)


def greedy_tokens(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (the first largest): the native kernel for a CPU fp32 matrix (torch's argmax keeps an index
    per element: ~10x slower at 32 rows of a 49k vocabulary), torch's elsewhere."""
    cpu_matrix = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[-1] > 0
    if cpu_matrix and native.fused_available():
        return native.argmax_rows(x.contiguous())
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, params_list, steps: list[int], prompts=None, outputs=None, eos_ids=()) -> list[int]:
    """logits [N, vocab]; one token per row. `steps[i]`: row i's outputs so far (its draw's counter and
    min_tokens' count); `prompts` / `outputs`: its token ids (penalties); `eos_ids`: the tokens min_tokens holds
    back with stop_token_ids. Greedy rows (temperature ~0 or top_k 1) take the argmax of the processed logits;
    the others are tempered, filtered (top_k, then top_p on what top_k kept, and min_p: p >= min_p * p_max) and
    drawn (module docstring: the exponential race, or the inverse CDF for a row keeping more than _PREFIX)."""
    x = process_logits(logits, params_list, steps, prompts, outputs, eos_ids)
    device = x.device
    rows = [i for i, p in enumerate(params_list) if not p.is_greedy]
    if len(rows) < len(params_list):
        out = greedy_tokens(x)
        if not rows:
            return out.tolist()
    ps = [params_list[i] for i in rows]
    xs = x if len(rows) == len(params_list) else x[torch.tensor(rows, device=device)]
    seeds = [(p.seed, steps[i]) for p, i in zip(ps, rows)]
    thr, (vals, ids) = _thresholds(xs, ps, device)
    # a row keeping at most _PREFIX tokens races them; one keeping more draws by its CDF (a rule of its own alone)
    few = torch.ones_like(thr, dtype=torch.bool)
    if vals.shape[-1] > _PREFIX:  # the vocabulary is larger: vals hold its _PREFIX + 1 largest at least
        few = vals[:, _PREFIX:_PREFIX + 1] < thr
        vals, ids = vals[:, :_PREFIX], ids[:, :_PREFIX]
    few = few.squeeze(1).tolist()
    drawn = torch.empty(len(rows), dtype=torch.long, device=device)
    racing = [j for j, f in enumerate(few) if f]
    if racing:
        at = torch.tensor(racing, device=device)
        keys = torch.tensor([row_key(*seeds[j]) for j in racing], dtype=torch.long, device=device)
        v = vals[at]
        drawn[at] = _race(v.masked_fill(v < thr[at], float("-inf")), keys, ids[at])
    wide = [j for j, f in enumerate(few) if not f]
    if wide:
        at = torch.tensor(wide, device=device)
        v = xs[at] / _col([ps[j].temperature for j in wide], device)
        drawn[at] = _inverse_cdf(v.masked_fill_(v < thr[at], float("-inf")), [seeds[j] for j in wide])
    if len(rows) == len(params_list):
        return drawn.tolist()
    out[torch.tensor(rows, device=device)] = drawn
    return out.tolist()


def _inverse_cdf(vals: torch.Tensor, seeds: list[tuple[int, int]]) -> torch.Tensor:
    """One draw per row from softmax(vals) (-inf = dropped): the first token, in token id order, whose
    cumulative probability reaches u * total, u uniform in (0, 1) from the row's (seed, step)."""
    probs = torch.exp(vals - vals.max(dim=-1, keepdim=True).values).double()
    cdf = probs.cumsum_(dim=-1)
    u = torch.tensor([row_uniform(*sd) for sd in seeds], dtype=torch.float64, device=vals.device)
    at = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    return at.clamp_(max=vals.shape[-1] - 1)


MAX_TOP_LOGPROBS = 20


def sampled_logprobs(logits: torch.Tensor, tokens: list[int], top_ns: list[int | None]) -> list[tuple | None]:
    """Per row, for rows that asked (top_n not None): (token's log-probability, ((id, logprob) of the top_n most
    likely tokens)), both under the model's own distribution, log_softmax of the raw logits (before penalties,
    bias, temperature or filters), as OpenAI's logprobs. None for rows that did not ask."""
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
