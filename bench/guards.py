"""What the safety machinery costs: the ownership/watermark guard and page scrubbing, on vs off,
plus the Redis page ledger's allocate/free round trips.

    python -m bench.guards [--repeats 7] [--quick] [--redis-url redis://127.0.0.1:6379/15]

Workload: 16 chat prompts of 16..256 tokens, 64 new tokens each (greedy, ignore_eos), run to
completion through `Engine.step` (prefill + decode); throughput = generated tokens / wall time.
Configurations, each its own engine on the same weights:

  on                 guards and scrubbing on (the default), LocalAllocator
  on_again           the same as `on`, a second engine: the A/A control (below)
  guards_off         Faults "no_ownership_guard,no_watermark_guard"
  scrub_off          Faults "no_scrub"
  ledger_on          allocator = RedisLedger (DB 15, a unique key prefix), guards and scrubbing on
  ledger_guards_off  the same with both guards off

Every round runs every configuration once, in a rotated order (on, guards_off, ... then
guards_off, ..., on), so load drift and position do not favour one. A ratio is on/off throughput
within a round; the figure is the median over rounds (throughputs are medians too). All configs
must produce the same tokens (checked). Guards/scrub are switched off ONLY through `Faults`.

Because the machine is shared and noisy, single runs wobble by several percent either way, far more
than what is measured. Two cross-checks: `*_best` ratios compare the best round of each config
(interference only ever slows a run, so the best round is the least disturbed), and the
`*_time_fraction` figures attribute time directly, from one extra instrumented run of `on`: the
time spent inside `BlockManager.check_reads` and `PagePool.scrub`, as a fraction of that run.
`ratio_on_vs_on_again` pairs two identical configurations the same way as the others: how far a ratio moves
here when nothing differs, so a ratio that far from 1 measures noise, not a cost (on a 2-core Zen 4 VM whose rounds
spread ~9 %, scrub on / off 0.982, 0.987 and 1.012 in three runs, the scrub 0.2 % of a run's time); the time
fractions are the figures that resolve a cost under 1 %.

The ledger latency figures come from `measure_latency` on a separate pool
registered under the same unique prefix; every pool is unregistered and every key under the prefix
deleted at the end (never FLUSHDB/FLUSHALL).
"""
import argparse
import contextlib
import gc
import os
import time
import uuid

import redis
import torch

from bench.common import chat_prompts, emit_json, log, median, print_table
from inference.allocator import LedgerError
from inference.arith import cdiv
import inference.engine
from inference.engine import Engine, EngineConfig
from inference.faults import Faults
from inference.ledger import RedisLedger
from inference.loader import load_model
from inference.sequence import SamplingParams
from inference.threads import threads_set

DEFAULT_REDIS_URL = os.environ.get("KVSERVE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
GUARDS_OFF = "no_ownership_guard,no_watermark_guard"


@contextlib.contextmanager
def shared_model():
    """Engines built inside share one `Llama` (weights only, no per-engine state): building five
    copies of the fused weights would cost seconds and ~1.4 GB for nothing."""
    real, built = inference.engine.Llama, {}

    def llama(config, weights, **kw):
        key = (id(weights), tuple(sorted(kw.items())))
        if key not in built:
            built[key] = real(config, weights, **kw)
        return built[key]

    inference.engine.Llama = llama
    try:
        yield
    finally:
        inference.engine.Llama = real


def run_once(engine: Engine, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(s.output_ids) for s in seqs) / dt, [s.output_ids for s in seqs]


def attribute(engine: Engine, prompts, new_tokens: int) -> dict:
    """One instrumented run: seconds inside the guard and the scrub, per run and per step."""
    bm, pool = engine.block_manager, engine.pool
    spent = {"guard": 0.0, "scrub": 0.0, "steps": 0}
    check, scrub, step = bm.check_reads, pool.scrub, engine.step

    def timed_check(*a, **kw):
        t = time.perf_counter()
        try:
            return check(*a, **kw)
        finally:
            spent["guard"] += time.perf_counter() - t

    def timed_scrub(*a, **kw):
        t = time.perf_counter()
        try:
            return scrub(*a, **kw)
        finally:
            spent["scrub"] += time.perf_counter() - t

    def counted_step():
        spent["steps"] += 1
        return step()

    bm.check_reads, pool.scrub, engine.step = timed_check, timed_scrub, counted_step
    try:
        t0 = time.perf_counter()
        run_once(engine, prompts, new_tokens)
        total = time.perf_counter() - t0
    finally:
        del bm.check_reads, pool.scrub, engine.step  # back to the class methods
    return dict(guard_time_fraction=spent["guard"] / total, scrub_time_fraction=spent["scrub"] / total,
                guard_us_per_step=spent["guard"] / max(1, spent["steps"]) * 1e6, steps=spent["steps"])


def measure_latency(ledger: RedisLedger, num_ops: int = 200, num_pages: int = 1) -> dict[str, float]:
    """p50/p99 microseconds of allocate and free round trips; run it on a pool with spare pages."""
    owner = f"latency-probe:{time.monotonic_ns()}"
    allocate_us, free_us = [], []
    for _ in range(num_ops):
        t0 = time.perf_counter_ns()
        grant = ledger.allocate(owner, num_pages)
        t1 = time.perf_counter_ns()
        if grant is None:
            raise LedgerError(
                f"pool {ledger.pool_id} has fewer than {num_pages} free pages; measure on a sandbox pool"
            )
        ledger.free(owner, grant.pages, grant.epochs)
        allocate_us.append((t1 - t0) / 1000)
        free_us.append((time.perf_counter_ns() - t1) / 1000)

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "allocate_p50_us": pct(allocate_us, 0.5),
        "allocate_p99_us": pct(allocate_us, 0.99),
        "free_p50_us": pct(free_us, 0.5),
        "free_p99_us": pct(free_us, 0.99),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.guards", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small smoke run (4 short prompts, 8 tokens, 1 round)")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--threads", type=int, help="torch threads (default: all CPUs; 1 with --quick)")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    # a smoke run on a loaded machine: one thread, since an OpenMP barrier waiting on a descheduled
    # second thread can stretch every op to a scheduler tick (measured: 30x slower)
    threads_set(args.threads or (1 if args.quick else os.cpu_count() or 1))
    n, lo, hi, new_tokens, latency_ops = (4, 16, 64, 8, 100) if args.quick else (16, 16, 256, 64, 1000)

    started = time.perf_counter()
    model = load_model()
    prompts = chat_prompts(model.tokenizer, n, lo, hi, seed=0)
    pages = sum(cdiv(len(p) + new_tokens, 16) for p in prompts) + 16
    client = redis.Redis.from_url(args.redis_url)
    client.ping()
    prefix = f"kvbench-{uuid.uuid4().hex[:10]}"
    ledgers: list[RedisLedger] = []

    def ledger_factory(num_pages: int) -> RedisLedger:
        ledger = RedisLedger.register(client, f"bench{len(ledgers)}", "sandbox", num_pages, 16, prefix=prefix)
        ledgers.append(ledger)
        return ledger

    def engine(faults: str = "", ledger: bool = False) -> Engine:
        config = EngineConfig(num_pages=pages, page_size=16, max_num_seqs=64, faults=Faults.parse(faults))
        return Engine(model, config, allocator_factory=ledger_factory if ledger else None)

    try:
        with shared_model():
            engines = {
                "on": engine(),
                "on_again": engine(),
                "guards_off": engine(GUARDS_OFF),
                "scrub_off": engine("no_scrub"),
                "ledger_on": engine(ledger=True),
                "ledger_guards_off": engine(GUARDS_OFF, ledger=True),
            }
        names = list(engines)
        log(f"bench.guards: {n} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
            f"{new_tokens} new tokens each, {repeats} rounds, configs {names}, ledger prefix {prefix} "
            f"(set up in {time.perf_counter() - started:.1f}s), {torch.get_num_threads()} threads")
        for e in engines.values():  # warm-up
            run_once(e, prompts[:2], 2)

        tput = {k: [] for k in names}
        reference, outputs_match = None, True
        for r in range(repeats):
            gc.collect()
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                tok_s, outputs = run_once(engines[name], prompts, new_tokens)
                tput[name].append(tok_s)
                reference = reference or outputs
                outputs_match &= outputs == reference
            log(f"round {r + 1}/{repeats}: " + ", ".join(f"{k} {tput[k][-1]:.1f}" for k in names)
                + f" tok/s ({time.perf_counter() - started:.0f}s)")

        def paired(a, b):
            return median([x / y for x, y in zip(tput[a], tput[b])])

        def best(a, b):  # other processes only ever slow a run down: best-of-rounds filters them out
            return max(tput[a]) / max(tput[b])

        shares = attribute(engines["on"], prompts, new_tokens)
        latency_pool = RedisLedger.register(client, "latency", "sandbox", 64, 16, prefix=prefix)
        ledgers.append(latency_pool)
        latency = measure_latency(latency_pool, num_ops=latency_ops)
    finally:
        for ledger in ledgers:
            try:
                ledger.unregister()
            except Exception as exc:  # keep cleaning up
                log(f"unregister {ledger.pool_id}: {exc}")
        leftover = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if leftover:
            client.delete(*leftover)
        client.close()

    med = {k: median(v) for k, v in tput.items()}
    result = dict(
        ratio_guards_on_vs_off=paired("on", "guards_off"),
        ratio_scrub_on_vs_off=paired("on", "scrub_off"),
        ratio_on_vs_on_again=paired("on", "on_again"),
        ratio_guards_on_vs_off_ledger=paired("ledger_on", "ledger_guards_off"),
        ratio_ledger_vs_local=paired("ledger_on", "on"),
        ratio_guards_on_vs_off_best=best("on", "guards_off"), ratio_scrub_on_vs_off_best=best("on", "scrub_off"),
        **{f"tok_s_{k}": v for k, v in med.items()},
        **shares,
        **{f"ledger_{k}": v for k, v in latency.items()},
        outputs_match=outputs_match, repeats=repeats, threads=torch.get_num_threads(), quick=args.quick, num_prompts=n, new_tokens=new_tokens,
        seconds=round(time.perf_counter() - started, 1),
        runs={k: [round(x, 2) for x in v] for k, v in tput.items()},
    )
    print_table([dict(config=k, tok_s=med[k], vs_on=med[k] / med["on"]) for k in names],
                title=f"bench.guards: end-to-end tok/s, medians of {repeats} rounds")
    print_table([
        dict(figure="guards on/off (local allocator)", value=result["ratio_guards_on_vs_off"], target=">= 0.97"),
        dict(figure="scrub on/off", value=result["ratio_scrub_on_vs_off"], target=">= 0.99"),
        dict(figure="guards on/off (Redis ledger)", value=result["ratio_guards_on_vs_off_ledger"], target=">= 0.97"),
        dict(figure="Redis ledger / local allocator", value=result["ratio_ledger_vs_local"], target="-"),
        dict(figure="on / on again (A/A: the noise)", value=result["ratio_on_vs_on_again"], target="-"),
        dict(figure="guards on/off, best of rounds", value=result["ratio_guards_on_vs_off_best"], target="-"),
        dict(figure="scrub on/off, best of rounds", value=result["ratio_scrub_on_vs_off_best"], target="-"),
        dict(figure="time in guard (fraction of run)", value=shares["guard_time_fraction"], target="-"),
        dict(figure="time in scrub (fraction of run)", value=shares["scrub_time_fraction"], target="-"),
        *[dict(figure=f"ledger {k} us", value=v, target="-") for k, v in latency.items()],
    ], title="ratios (paired per round, median) and ledger latency")
    if not outputs_match:
        log("WARNING: configurations produced different tokens")
    emit_json(result)
    return 0 if outputs_match else 1


if __name__ == "__main__":
    raise SystemExit(main())
