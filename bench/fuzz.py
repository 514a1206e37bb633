"""Differential fuzzer: `python -m bench.fuzz [--seed S] [--schedules N] [--schedule K] [--model real|tiny]`.

Each schedule (seeded: schedule K of seed S is always the same) runs requests from two tenants through one
in-process engine (inference.engine.Engine on a HostLedger over a real RedisLedger, prefix cache on, a pool
small enough to force preemption and evictions): staggered arrivals, shared system prompts (the same text
in both tenants' scopes, so a cross-scope hit would show), a unique sentinel in every prompt, stop strings,
aborts (at a random step, possibly before admission) and disconnects (an abort after the client saw some
tokens), and requests of n > 1 choices (prefilled once on a plain prefill engine, forked into the fuzzed engine
with Engine.add_prefilled_choices: the choices share the prompt's pages under the request's own scope, are
preempted and recomputed on their own, and all end with the request's abort). Every greedy output (every
choice's: greedy choices are the same answer) is then compared with the same request run alone on a plain engine (no prefix
cache, a pool that never preempts):

- a request that finished: equal token for token (and text);
- an aborted one: its tokens are a prefix of the alone output;
- the tolerance rule, where float math can flip a near-tie: at the first differing position i, the alone
  run's distribution teacher-forced at i (the plain engine on prompt + alone[:i]) has top-2 log-probability
  margin below --tie-margin, and the schedule's token at i is that runner-up. Such flips are reported with
  their margin; anything else is a divergence.

No output may hold another request's sentinel (bench.chaos_clients.sightings). After each schedule the
engine must hold no request and the pool no page but its prefix cache's (chaos_stack.pool_report), with
check_integrity passing. Prints one line per schedule, every divergence with its replay command
(`python -m bench.fuzz --seed S --schedule K`), and ends with one JSON line.
"""
import argparse
import hashlib
import os
import random
import string
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from bench.chaos_clients import sightings
from bench.chaos_stack import pool_report
from bench.common import emit_json, log
from inference.engine import Engine, EngineConfig
from inference.host_ledger import HostLedger
from inference.kv_cache import cdiv
from inference.ledger import RedisLedger
from inference.sequence import SamplingParams

REDIS_URL = os.environ.get("KVSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
TENANTS = ("fuzz-a", "fuzz-b")
PAGE_SIZE = 16  # the alone runs' (a schedule draws its own: 4, 8 or 16)
SYSTEMS = [  # shared prefixes: long enough to fill whole pages, drawn by both tenants
    "You are a careful assistant for a bank. Never reveal one customer's data to another customer. "
    "Answer briefly and politely, in plain English, without markdown. " * 2,
    "You are a terse assistant. You repeat codes exactly as written and add nothing else to them. " * 3,
    "You are a storyteller who writes short stories about dragons, rivers, mountains and old cities. " * 4,
]
ASKS = ["Repeat the code exactly.", "Repeat the code exactly.", "What is the code? Answer with the code only.",
        "Write one sentence that contains the code.", "Tell a short story about a dragon who guards the code.",
        "Spell the code, then say goodbye."]
FILLER = " The weather in the mountains was calm and the river was quiet that day."
STOPS = [".", " the", "\n", "code", "-"]


def new_sentinel(rng: random.Random) -> str:
    """The canary's sentinel shape (chaos_clients.SENTINEL_RE), drawn from the schedule's own generator."""
    def part():
        return rng.choice(string.ascii_uppercase) + rng.choice(string.digits) + rng.choice(string.ascii_uppercase)

    return "-".join(part() for _ in range(3))


def salt_of(tenant: str) -> str:
    """A tenant's prefix-cache scope, as the server derives one per tenant (any string names a scope)."""
    return hashlib.sha256(f"kvserve-fuzz-scope:{tenant}".encode()).hexdigest()


@dataclass
class Req:
    rid: str
    tenant: str
    sentinel: str
    prompt_ids: list[int]
    params: SamplingParams
    arrive: int  # engine step at which it is added
    abort_at: int | None = None  # abort at this step (it may still be waiting)
    disconnect_after: int | None = None  # abort once it has this many output tokens
    seq: object = None
    aborted: bool = False
    n: int = 1  # choices (forked after a prefill of its own)
    seqs: list = field(default_factory=list)  # its choices' sequences (n > 1)

    @property
    def outputs(self) -> list:
        """The sequences whose outputs are judged: the request's, or each of its choices'."""
        return self.seqs if self.n > 1 else [self.seq]

    @property
    def done(self) -> bool:
        return all(s.is_done for s in self.outputs)

    def describe(self) -> str:
        p = self.params
        how = (f" abort@{self.abort_at}" if self.abort_at is not None else "") + (
            f" disconnect@{self.disconnect_after}tok" if self.disconnect_after else "")
        return (f"{self.rid} {self.tenant} arrive@{self.arrive} prompt={len(self.prompt_ids)} max={p.max_tokens}"
                f"{f' n={self.n}' if self.n > 1 else ''}"
                f"{' stop=' + repr(p.stop) if p.stop else ''}{how}")


@dataclass
class Schedule:
    seed: int
    index: int
    page_size: int
    num_pages: int
    chunk_size: int
    max_num_seqs: int
    reqs: list[Req] = field(default_factory=list)


def make_schedule(tokenizer, seed: int, index: int, max_requests: int, choices_rate: float = 0.25) -> Schedule:
    """Schedule `index` of `seed`; `choices_rate`: the share of requests of n > 1 choices (0: none, and the
    schedule is the one this seed and index gave before n > 1 was fuzzed)."""
    rng = random.Random(f"kvserve-fuzz:{seed}:{index}")
    reqs = []
    for i in range(rng.randint(max(2, max_requests // 2), max_requests)):
        tenant = TENANTS[rng.randrange(2)]
        sentinel = new_sentinel(rng)
        user = f"The secret code is {sentinel}.{FILLER * rng.choice([0, 0, 1, 2, 4])} {rng.choice(ASKS)}"
        ids = tokenizer.encode_chat([{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": user}])
        stop = (rng.choice(STOPS),) if rng.random() < 0.3 else ()
        params = SamplingParams(max_tokens=rng.choice([6, 12, 16, 20]), stop=stop, seed=0, tenant=tenant)
        r = Req(f"s{index}-r{i}", tenant, sentinel, ids, params, arrive=rng.choice([0, 0, 0, 1, 2, 4, 8, 16]))
        roll = rng.random()
        if roll < 0.12:
            r.abort_at = r.arrive + rng.randint(0, 6)
        elif roll < 0.24:
            r.disconnect_after = rng.randint(1, max(1, params.max_tokens // 2))
        choices = random.Random(f"kvserve-fuzz-n:{seed}:{index}:{i}")  # its own draw: older schedules stay as they were
        r.n = choices.choice([2, 3, 4]) if choices.random() < choices_rate else 1
        reqs.append(r)
    page_size = rng.choice([4, 8, 16])
    # a request of n choices holds its prompt once and each choice's own pages (at most one page of the prompt each)
    need = max(cdiv(len(r.prompt_ids) + r.params.max_tokens, page_size)
               + (r.n - 1) * cdiv(r.params.max_tokens + page_size, page_size) for r in reqs)
    prompts = sorted((cdiv(len(r.prompt_ids), page_size) for r in reqs), reverse=True)
    # two prompts that fit but cannot both grow (preemption), up to roomy enough to keep a prefix cache
    num_pages = max(need, prompts[0] + prompts[1] + rng.choice([0, 1, 2])) if rng.random() < 0.6 else \
        need + rng.choice([1, 2, 4, 8, 16]) * 16 // page_size
    return Schedule(seed, index, page_size, num_pages, rng.choice([16, 32, 64, 512]), rng.choice([2, 3, 4, 8]), reqs)


class Alone:
    """Each request run alone on a plain engine (no prefix cache, a pool that never preempts), memoized;
    and the alone run's top-2 margin at a position (teacher-forced)."""

    def __init__(self, model, num_pages: int = 96):
        self.engine = Engine(model, EngineConfig(num_pages=num_pages, page_size=PAGE_SIZE, prefix_cache=False))
        self.memo: dict = {}

    def run(self, prompt: list[int], params: SamplingParams):
        key = (tuple(prompt), params)
        if key not in self.memo:
            (seq,) = self.engine.generate([prompt], params)
            self.memo[key] = (list(seq.output_ids), seq.text, seq.finish_reason)
        return self.memo[key]

    def top2(self, prompt: list[int], forced: list[int]) -> tuple[tuple[int, float], tuple[int, float]]:
        """((id, logprob), (id, logprob)) of the two likeliest next tokens after prompt + forced."""
        seq = self.engine.add_request(f"tf-{uuid.uuid4().hex[:8]}", prompt + forced,
                                      SamplingParams(max_tokens=1, ignore_eos=True, logprobs=2, seed=0))
        got = None
        while self.engine.has_work:
            for event in self.engine.step():
                if event.seq is seq and event.logprobs:
                    got = event.logprobs
        self.engine.seqs.pop(seq.request_id, None)
        return tuple(got[1][:2])


class Counting:
    """Wraps the prefix cache's evict to count evicted pages."""

    def __init__(self, cache):
        self.evicted, inner = 0, cache.evict

        def evict(n):
            got = inner(n)
            self.evicted += got
            return got

        cache.evict = evict


def run_schedule(model, sch: Schedule, client, prefix: str, max_steps: int = 5000) -> dict:
    pool_id = f"fuzz-{sch.seed}-{sch.index}-{uuid.uuid4().hex[:6]}"
    ledgers = []

    def allocator(n):
        ledgers.append(HostLedger(RedisLedger.register(client, pool_id, "decode", n, sch.page_size, prefix=prefix,
                                                       lease_ttl_s=600)))
        return ledgers[0]

    engine = Engine(model, EngineConfig(num_pages=sch.num_pages, page_size=sch.page_size, chunk_size=sch.chunk_size,
                                        max_num_seqs=sch.max_num_seqs, prefix_cache=True), allocator_factory=allocator)
    prefill = Engine(model, EngineConfig(num_pages=512, page_size=sch.page_size))  # n > 1 requests' one prefill
    evictions = Counting(engine.prefix_cache)
    problems = []
    step = 0
    try:
        pending = sorted(sch.reqs, key=lambda r: r.arrive)
        forks = []  # n > 1 requests prefilled, waiting for their choices to fit
        while step < max_steps:
            while pending and pending[0].arrive <= step:
                r = pending.pop(0)
                if r.n > 1:
                    forks.append((r, prefilled(prefill, r)))
                else:
                    r.seq = engine.add_request(r.rid, r.prompt_ids, r.params, salt=salt_of(r.tenant))
            for r, (first, blob) in list(forks):
                if r.abort_at is not None and step >= r.abort_at:  # ended before its choices were admitted
                    forks.remove((r, (first, blob)))
                    r.aborted, r.seqs = True, []
                    continue
                got = engine.add_prefilled_choices(r.rid, r.prompt_ids, first, blob, [r.params] * r.n)
                if got is not None:
                    forks.remove((r, (first, blob)))
                    r.seqs, r.seq = got, got[0]
            for r in sch.reqs:
                if r.seq is None or r.aborted or r.done:
                    continue
                if (r.abort_at is not None and step >= r.abort_at) or (
                        r.disconnect_after and len(r.seq.output_ids) >= r.disconnect_after):
                    engine.abort(r.rid, "client_disconnected")
                    r.aborted = True
            if not pending and not forks and not engine.has_work:
                break
            engine.step()
            step += 1
        else:
            problems.append(f"not finished after {max_steps} steps")
        engine.pop_finished()
        if engine.seqs:
            problems.append(f"engine still holds {sorted(engine.seqs)} after every request ended")
        report = pool_report(client, prefix, pool_id)
        if report["owned"] or report["dirty"] or report["integrity"] != "ok":
            problems.append(f"pool after drain: {report}")
        if engine.groups:
            problems.append(f"engine still holds the shared pages of {sorted(engine.groups)}")
        if report["cached"] != len(engine.prefix_cache):
            problems.append(f"ledger has {report['cached']} cached pages, the engine's index {len(engine.prefix_cache)}")
        hits = sum(engine.prefix_cache.hits.values())
        return {"steps": step, "problems": problems, "preemptions": engine.scheduler.num_preemptions,
                "choice_preemptions": sum(c.num_preemptions for r in sch.reqs if r.n > 1 for c in r.seqs),
                "prefix_hits": hits, "evicted_pages": evictions.evicted, "cached_at_end": report["cached"]}
    finally:
        if ledgers:
            ledgers[0].ledger.unregister()


def prefilled(prefill: Engine, r: Req) -> tuple[list[int], object]:
    """Every choice's first token and the prompt's KV blob of an n > 1 request, from one prefill."""
    seq = prefill.add_request(r.rid, r.prompt_ids, r.params, prefill_only=True, choices=r.n)
    while not seq.is_done:
        prefill.step()
    blob, _ = prefill.export_kv(seq)
    prefill.release(seq)
    return list(seq.choice_tokens), blob


def compare(alone: Alone, r: Req, tie_margin: float, seq=None) -> dict | None:
    """None when r's output (or its choice `seq`'s) agrees with its alone run; else what differs (a tolerated
    near-tie flip has "tolerated": True and its margin)."""
    seq = seq or r.seq
    ref_ids, ref_text, ref_reason = alone.run(r.prompt_ids, r.params)
    got = list(seq.output_ids)
    if seq.error and not r.aborted:
        return {"what": f"failed: {seq.error}", "tolerated": False}
    if r.aborted:
        if got == ref_ids[:len(got)]:
            return None
    elif got == ref_ids and seq.text == ref_text and seq.finish_reason == ref_reason:
        return None
    i = next((k for k, (a, b) in enumerate(zip(got, ref_ids)) if a != b), None)
    if i is None:  # one is a prefix of the other: a different stop
        return {"what": f"length {len(got)} ({seq.finish_reason}) vs alone {len(ref_ids)} ({ref_reason})",
                "tolerated": False}
    (best, best_lp), (second, second_lp) = alone.top2(r.prompt_ids, ref_ids[:i])
    margin = best_lp - second_lp
    tolerated = got[i] == second and margin < tie_margin
    return {"what": f"token {i}: {got[i]} vs alone {ref_ids[i]} (alone runner-up {second})", "position": i,
            "margin": margin, "tolerated": tolerated}


def fuzz_one(model, alone: Alone, seed: int, index: int, args, client, prefix: str) -> dict:
    sch = make_schedule(model.tokenizer, seed, index, args.requests, getattr(args, "choices", 0.25))
    t = time.perf_counter()
    ran = run_schedule(model, sch, client, prefix)
    planted = {r.sentinel for r in sch.reqs}
    divergences, ties, foreign, echoed = [], [], [], 0
    for r in sch.reqs:
        for seq in r.outputs if r.seq is not None else []:
            seen = sightings([seq.text], {r.sentinel}, planted)
            foreign += [f"{seq.request_id} ({r.tenant}) output holds {s}" for s in seen]
            echoed += r.sentinel in seq.text
            diff = compare(alone, r, args.tie_margin, seq)
            if diff:
                diff["request"] = r.describe() + (f" choice {seq.index}" if r.n > 1 else "")
                (ties if diff["tolerated"] else divergences).append(diff)
    replay = f"python -m bench.fuzz --seed {seed} --schedule {index}" + (" --model tiny" if args.model == "tiny" else "") \
        + (f" --choices {args.choices}" if getattr(args, "choices", 0.25) != 0.25 else "")
    return {"seed": seed, "schedule": index, "requests": len(sch.reqs), "page_size": sch.page_size, "num_pages": sch.num_pages,
            "chunk_size": sch.chunk_size, "max_num_seqs": sch.max_num_seqs,
            "aborted": sum(r.aborted for r in sch.reqs), "stops": sum(bool(r.params.stop) for r in sch.reqs),
            "choices": sum(r.n for r in sch.reqs if r.n > 1),
            "echoed_own_sentinel": echoed, **ran, "divergences": divergences, "near_ties": ties,
            "foreign_sightings": foreign, "wall_s": time.perf_counter() - t, "replay": replay,
            "passed": not (divergences or foreign or ran["problems"])}


def load(model_choice: str):
    from inference.loader import load_model

    if model_choice == "real":
        return load_model()
    from inference.tiny import write_tiny

    return load_model(write_tiny(tempfile.mkdtemp(prefix="kvfuzz-tiny-"))["gguf"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--schedules", type=int, default=20, help="schedules to run: 0..N-1 of the seed")
    parser.add_argument("--schedule", type=int, default=None, help="run only this schedule of the seed (replay)")
    parser.add_argument("--requests", type=int, default=8, help="most requests in one schedule")
    parser.add_argument("--model", choices=("real", "tiny"), default="real",
                        help="real: the default SmolLM2 (outputs meaningful: sentinels echoed); tiny: random weights")
    parser.add_argument("--tie-margin", type=float, default=0.01,
                        help="a flip at a position whose alone top-2 log-prob margin is below this is tolerated")
    parser.add_argument("--seconds", type=float, default=None, help="stop starting schedules after this long")
    parser.add_argument("--choices", type=float, default=0.25,
                        help="share of requests with n > 1 choices (2..4), forked after one prefill")
    args = parser.parse_args(argv)
    import redis

    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    indices = [args.schedule] if args.schedule is not None else list(range(args.schedules))
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"kvsfuzz-{uuid.uuid4().hex[:8]}"
    began = time.perf_counter()
    model = load(args.model)
    alone = Alone(model)
    results = []
    log(f"fuzz seed {seed}, schedules {indices[0]}..{indices[-1]}, model {args.model}")
    try:
        for k in indices:
            if args.seconds and time.perf_counter() - began > args.seconds:
                break
            res = fuzz_one(model, alone, seed, k, args, client, prefix)
            results.append(res)
            print(f"seed {seed} schedule {k}: {res['requests']} requests, {res['num_pages']} pages of {res['page_size']}, "
                  f"{res['preemptions']} preemptions, {res['prefix_hits']} prefix hits, {res['evicted_pages']} evicted, "
                  f"{res['aborted']} aborted, {len(res['divergences'])} divergences, {len(res['near_ties'])} near ties, "
                  f"{len(res['foreign_sightings'])} foreign, {res['wall_s']:.1f} s: {'ok' if res['passed'] else 'FAIL'}",
                  flush=True)
            for d in res["divergences"] + res["near_ties"]:
                kind = "near tie (tolerated)" if d["tolerated"] else "DIVERGENCE"
                margin = f", margin {d['margin']:.5f}" if "margin" in d else ""
                print(f"  {kind}: {d['request']}: {d['what']}{margin}; replay: {res['replay']}", flush=True)
            for line in res["foreign_sightings"] + res["problems"]:
                print(f"  FAIL: {line}; replay: {res['replay']}", flush=True)
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    failing = [r for r in results if not r["passed"]]
    summary = {
        "bench": "fuzz", "seed": seed, "model": args.model, "schedules_run": len(results),
        "requests": sum(r["requests"] for r in results), "preemptions": sum(r["preemptions"] for r in results),
        "prefix_hits": sum(r["prefix_hits"] for r in results), "evicted_pages": sum(r["evicted_pages"] for r in results),
        "aborted": sum(r["aborted"] for r in results), "stops": sum(r["stops"] for r in results),
        "choices": sum(r["choices"] for r in results),
        "echoed_own_sentinel": sum(r["echoed_own_sentinel"] for r in results),
        "divergences": [dict(d, replay=r["replay"]) for r in results for d in r["divergences"]],
        "near_ties": [dict(d, replay=r["replay"]) for r in results for d in r["near_ties"]],
        "foreign_sightings": [s for r in results for s in r["foreign_sightings"]],
        "problems": [dict(problem=p, replay=r["replay"]) for r in results for p in r["problems"]],
        "tie_margin": args.tie_margin, "failing_schedules": [r["replay"] for r in failing],
        "wall_s": time.perf_counter() - began, "passed": bool(results) and not failing,
    }
    emit_json(summary)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
