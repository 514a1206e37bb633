"""One request's n choices (`n`, `best_of`): the bound on their number, each choice's seed and engine id, the
request's own scope for the prompt pages its choices share, and the rule that keeps the best `n` of `best_of`.
The choices of a request are forked by the decode engine after its one handoff is verified
(Engine.add_prefilled_choices); the prefill engine samples every choice's first token from the prompt's logits."""
import hashlib
import re
from dataclasses import dataclass, replace

from inference.events import ChoiceEnd
from inference.sequence import SamplingParams

MAX_CHOICES = 8  # n and best_of are at most this (a 400 naming the field above it)
SCOPE_PREFIX = "choices-"  # a request's own scope; a tenant's salt is 64 hex characters, never this
_CHOICE_ID = re.compile(r"(.+)/c(\d+)")


def choice_id(request_id: str, index: int) -> str:
    """The engine and ledger owner of choice `index` of `request_id`."""
    return f"{request_id}/c{index}"


def request_of(owner: str) -> str:
    """The request an engine owner belongs to: itself, or the request whose choice it is."""
    m = _CHOICE_ID.fullmatch(owner)
    return m.group(1) if m else owner


def choice_scope(request_id: str) -> str:
    """The scope (salt) of the prompt pages `request_id`'s choices share: derived from the request id alone, so it
    equals no tenant's cache scope and no other request's."""
    return SCOPE_PREFIX + hashlib.sha256(request_id.encode()).hexdigest()[:40]


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 samples with the request's seed (n=1's stream); choice i > 0 with a seed derived from it and i."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"kvserve-choice\0{seed}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def choice_params(params: SamplingParams, count: int, score: bool = False) -> list[SamplingParams]:
    """The sampling parameters of each of `count` choices; `score` (best_of) makes the engine compute every
    sampled token's log-probability (its cumulative logprob ranks the choice)."""
    logprobs = 0 if score and params.logprobs is None else params.logprobs
    return [replace(params, seed=choice_seed(params.seed, i), logprobs=logprobs) for i in range(count)]


def best_choices(ends: list[ChoiceEnd], n: int, ranked: bool) -> list[ChoiceEnd]:
    """The choices returned: with `ranked` (best_of > n) the n with the highest cumulative logprob, best first
    (ties: lower index first); else the first n by index."""
    if not ranked:
        return sorted(ends, key=lambda e: e.index)[:n]
    return sorted(ends, key=lambda e: (-(e.cumulative_logprob if e.cumulative_logprob is not None
                                         else float("-inf")), e.index))[:n]


@dataclass
class ChoiceGroup:
    """The decode engine's record of one request's choices: the shared prompt pages (held by the request scope's
    cache entry) and the choices still holding pages; the pages go back, scrubbed, when the last one leaves."""

    scope: str
    pages: list[int]
    epochs: list[int]
    members: set[str]
