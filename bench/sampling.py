"""Decode with every sampling knob set against plain greedy, side by side in one process, one run.

    python -m bench.sampling [--repeats 5] [--quick] [--tiny] [--threads N]

Workload: 32 chat prompts (chat template applied) of deterministic mixed lengths 16..256 tokens, each decoding
64 new tokens (ignore_eos, so both sides generate the same number of tokens); `--quick`: 8 prompts, 16 tokens,
2 rounds. Greedy is SamplingParams(max_tokens, ignore_eos); "knobs" sets every knob the sampler has on every
sequence: temperature, top_k, top_p, min_p, frequency / presence / repetition penalties, logit_bias, min_tokens,
stop_token_ids (a token it never reaches), stop strings (one it never writes) and a seed per sequence.
Each round runs greedy then knobs on one engine (the order alternates between rounds); decode tok/s excludes
prefill as bench.engine does (the clock starts once every sequence is RUNNING). The ratio is the median over
rounds of that round's knobs/greedy ratio, so a burst of load from other processes spoils one pair, not a median.
Target: ratio >= 0.9. `--tiny` runs the tiny random-weight model (inference/tiny.py) instead of the real one:
the forward pass is then nearly free, so it measures the sampler's cost alone (a much harsher ratio).

Ends with one JSON line: greedy_tok_s, knobs_tok_s (medians), ratio, and the flags it ran with."""
import argparse
import gc
import tempfile
import time

import torch

from bench.common import chat_prompts, emit_json, log, median, print_table
from inference.engine import Engine, EngineConfig
from inference.arith import cdiv
from inference.loader import load_model
from inference.sequence import SamplingParams, SeqStatus
from inference.threads import threads_set

TARGET = 0.9


def knobs(i: int, max_tokens: int, vocab: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_k=50, top_p=0.95, min_p=0.05,
                          frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1,
                          logit_bias=((11, 2.0), (13, -3.0), (vocab - 1, -100.0)), min_tokens=8,
                          stop_token_ids=(vocab - 1,), stop=("<<never said>>",), seed=1000 + i)


def decode_tok_s(engine: Engine, prompts, params: list[SamplingParams]) -> float:
    tag = time.monotonic_ns()
    seqs = [engine.add_request(f"bench-{tag}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while any(s.status is not SeqStatus.RUNNING and not s.is_done for s in seqs):
        engine.step()
    n0 = engine.num_decode_tokens
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    elapsed = time.perf_counter() - t0
    engine.pop_finished()
    return (engine.num_decode_tokens - n0) / elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small smoke run (8 prompts, 16 tokens, 2 rounds)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight model: the sampler's cost alone")
    parser.add_argument("--threads", type=int, help="torch threads (default: all CPUs)")
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    if args.threads:
        threads_set(args.threads)
    started = time.perf_counter()
    if args.tiny:
        from inference.tiny import write_tiny

        model = load_model(write_tiny(tempfile.mkdtemp(prefix="bench-sampling-"))["gguf"])
    else:
        model = load_model()
    n, new = (8, 16) if args.quick else (32, 64)
    prompts = chat_prompts(model.tokenizer, n, 16, 256, seed=0)
    vocab = model.config.vocab_size
    plans = {"greedy": [SamplingParams(max_tokens=new, ignore_eos=True) for _ in prompts],
             "knobs": [knobs(i, new, vocab) for i in range(n)]}
    pages = sum(cdiv(len(p) + new, 16) for p in prompts)
    engine = Engine(model, EngineConfig(num_pages=max(1024, pages + 64), page_size=16, chunk_size=512,
                                        max_num_seqs=max(64, n)))
    log(f"bench.sampling: {n} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, {new} new "
        f"tokens, {repeats} rounds, {torch.get_num_threads()} threads, model {'tiny' if args.tiny else 'real'}")
    for name, plan in plans.items():  # warm-up
        decode_tok_s(engine, prompts[:2], [sp for sp in plan[:2]])
    runs = {"greedy": [], "knobs": []}
    for r in range(repeats):
        order = ("greedy", "knobs") if r % 2 == 0 else ("knobs", "greedy")
        for name in order:
            gc.collect()
            runs[name].append(decode_tok_s(engine, prompts, plans[name]))
        log(f"round {r + 1}/{repeats}: greedy {runs['greedy'][-1]:.1f} tok/s, knobs {runs['knobs'][-1]:.1f} tok/s "
            f"({time.perf_counter() - started:.0f}s)")
    ratio = median([k / g for k, g in zip(runs["knobs"], runs["greedy"])])
    result = dict(greedy_tok_s=median(runs["greedy"]), knobs_tok_s=median(runs["knobs"]), ratio=ratio, target=TARGET,
                  meets_target=ratio >= TARGET, num_seqs=n, new_tokens=new, repeats=repeats, quick=args.quick,
                  tiny=args.tiny, threads=torch.get_num_threads(), seconds=round(time.perf_counter() - started, 1),
                  runs={k: [round(x, 2) for x in v] for k, v in runs.items()})
    print_table([dict(figure=f"decode tok/s, {n} sequences", greedy=result["greedy_tok_s"],
                      knobs=result["knobs_tok_s"], ratio=ratio, target=TARGET)],
                title=f"bench.sampling: medians of {repeats} interleaved rounds ({torch.get_num_threads()} threads)")
    emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
