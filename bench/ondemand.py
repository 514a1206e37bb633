"""Pages on demand against reserve-whole: concurrent sequences and throughput on one fixed pool.

    python -m bench.ondemand [--repeats 3] [--quick] [--threads N]

Workload: N requests, all submitted at once, each asking max_tokens = 1,024 and stopping at EOS long
before. The model is the tiny random-weight Llama (`inference.tiny`, written to a temp dir): its tokenizer
is told that EOS_IDS of its 265 ids end a reply, and requests sample at temperature 1 with a fixed seed
each, so a reply ends after a geometric number of tokens (the median is printed) — the same tokens in
both modes (sampling is seeded per request and token index, whatever the batch).

Both modes run in the same process, on the same pool (--pages x 16 tokens), max_num_seqs 256, one after
the other in each round (rounds interleave the two, medians over rounds):
  * reserve_whole: `EngineConfig(reserve_whole=True)`, the old admission reservation of prompt +
    max_tokens pages (kept only for this comparison; no env variable reaches it);
  * on_demand: the default, pages as sequences grow, preemption when the pool runs out.
Concurrent sequences = sequences holding pages (PREFILLING or RUNNING) after each step: the peak, and the
median over the steps after which requests were still waiting (while demand exceeds what the pool admits;
the draining tail, where fewer requests are left than fit, says nothing about capacity). Throughput =
output tokens / wall seconds of the whole run (tail included).

`--quick` (smoke runs) asks max_tokens 256 of a 64-page pool with 16 requests, one round.

Ends with one JSON line: the figures of each mode and `ratio_concurrent_median` (target >= 2).
"""
import argparse
import dataclasses
import random
import tempfile

from bench.common import emit_json, log, median, now, print_table
from inference.threads import threads_set

MAX_TOKENS = 1024
EOS_IDS = 6  # how many token ids end a reply (the tiny vocabulary has 265)


def tiny_eos_model(tmp):
    """The tiny model whose tokenizer ends a reply on EOS_IDS ids (its own EOS among them)."""
    from inference.loader import load_model
    from inference.tiny import write_tiny

    model = load_model(write_tiny(tmp)["gguf"])
    tok = model.tokenizer
    ids = tuple(dict.fromkeys((*tok.eos_ids, *range(200, 200 + EOS_IDS))))[:EOS_IDS]
    return dataclasses.replace(model, tokenizer=dataclasses.replace(tok, eos_ids=ids))


def workload(n: int, max_tokens: int, seed: int = 0):
    from inference.sequence import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 190) for _ in range(rng.randint(32, 96))] for _ in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i) for i in range(n)]
    return prompts, params


def run_mode(model, pages: int, prompts, params, reserve_whole: bool) -> dict:
    from inference.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(num_pages=pages, page_size=16, max_num_seqs=256, window=2048,
                                        reserve_whole=reserve_whole))
    seqs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    running, saturated, held = [], [], []
    t0 = now()
    while engine.has_work:
        engine.step()
        running.append(len(engine.scheduler.active))
        if engine.scheduler.waiting:  # demand exceeds what the pool admits: the pool bounds concurrency
            saturated.append(running[-1])
        held.append(pages - engine.block_manager.num_free())
    seconds = now() - t0
    engine.block_manager.allocator.check_integrity()
    tokens = sum(len(s.output_ids) for s in seqs)
    return {"peak_running": max(running), "median_running": median(saturated or running), "steps": len(running),
            "tok_s": tokens / seconds, "req_s": len(seqs) / seconds, "seconds": seconds, "tokens": tokens,
            "median_output_tokens": median([len(s.output_ids) for s in seqs]),
            "stopped_at_eos": sum(s.finish_reason == "stop" for s in seqs),
            "median_pages_held": median(held), "preemptions": engine.scheduler.num_preemptions,
            "outputs": [tuple(s.output_ids) for s in seqs]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ondemand", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small smoke run (fewer requests, smaller pool, 1 round)")
    parser.add_argument("--requests", type=int, help="requests per run (default 128; quick 16)")
    parser.add_argument("--pages", type=int, help="pool pages of 16 tokens (default 512; quick 64)")
    parser.add_argument("--max-tokens", type=int, help=f"max_tokens of every request (default {MAX_TOKENS}; quick 256)")
    parser.add_argument("--threads", type=int, help="torch threads (default: KVSERVE_TORCH_THREADS or all CPUs)")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        threads_set(args.threads)
    n = args.requests or (16 if args.quick else 128)
    pages = args.pages or (64 if args.quick else 512)
    max_tokens = args.max_tokens or (256 if args.quick else MAX_TOKENS)
    rounds = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_eos_model(tmp)
        prompts, params = workload(n, max_tokens)
        results = {"reserve_whole": [], "on_demand": []}
        for r in range(rounds):
            for mode in (["reserve_whole", "on_demand"] if r % 2 == 0 else ["on_demand", "reserve_whole"]):
                results[mode].append(run_mode(model, pages, prompts, params, mode == "reserve_whole"))
                log(f"round {r + 1}/{rounds} {mode}: {results[mode][-1]['seconds']:.1f}s")
    keys = ("peak_running", "median_running", "tok_s", "req_s", "steps", "median_output_tokens", "stopped_at_eos",
            "median_pages_held", "preemptions")
    summary = {mode: {k: median([run[k] for run in runs]) for k in keys} for mode, runs in results.items()}
    rows = [{"mode": mode, **vals} for mode, vals in summary.items()]
    print(f"{n} requests, max_tokens {max_tokens}, pool {pages} pages x 16 tokens, medians of {rounds} round(s)")
    print_table(rows, ["mode", *keys])
    rw, od = summary["reserve_whole"], summary["on_demand"]
    match = all(a["outputs"] == b["outputs"] for a, b in zip(results["reserve_whole"], results["on_demand"]))
    ratios = {"ratio_concurrent_median": od["median_running"] / rw["median_running"],
              "ratio_concurrent_peak": od["peak_running"] / rw["peak_running"],
              "ratio_tok_s": median([b["tok_s"] / a["tok_s"] for a, b in zip(results["reserve_whole"],
                                                                           results["on_demand"])])}
    print("on demand / reserve-whole: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
          + f"; outputs identical: {match}")
    emit_json({"bench": "ondemand", "requests": n, "pages": pages, "max_tokens": max_tokens, "rounds": rounds,
               "eos_ids": EOS_IDS, "outputs_match": match, **ratios,
               **{f"{mode}_{k}": v for mode, vals in summary.items() for k, v in vals.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
