"""What structured outputs cost on the decode path: 32 sequences decoding with a JSON schema on every one against the
same 32 without, in one process, interleaved rounds.

    python -m bench.grammar [--repeats 3] [--quick] [--threads N]

Workload: 32 chat prompts of 16..256 tokens (bench.common.chat_prompts), each decoding N new tokens (64; --quick: 8
prompts, 16 tokens, 1 round) with ignore_eos, so both sides run the same number of steps over the same batch. The
schema's `bio` string has minLength 4000, so no grammar can end inside N tokens: every step masks all 32 rows (the
bitmask filled per row by xgrammar, applied in place). The clock starts once every sequence is decoding (prefill
and first tokens excluded, as bench.engine). Grammars are compiled before the clock starts (a cached spec, as the
workers see repeated schemas).

Figures: decode tok/s with and without the schema (medians over rounds), `ratio_grammar` = the median over rounds
of that round's grammar/plain tok/s, `mask_cost` = 1 - ratio_grammar (target <= 0.10), and `mask_share` = the time
inside grammar_mask + grammar_accept over the grammar run's time (measured directly, median over rounds). Ends with
one JSON line (device, threads and flags included)."""
import argparse
import time

import torch

from bench.common import chat_prompts, emit_json, log, median, print_table
from inference import engine as engine_module
from inference.arith import cdiv
from inference.engine import Engine, EngineConfig
from inference.grammar import compiler_for
from inference.loader import load_model
from inference.sequence import SamplingParams, SeqStatus
from inference.threads import threads_set

SCHEMA = {"type": "object", "required": ["name", "age", "bio"],
          "properties": {"name": {"type": "string", "maxLength": 32}, "age": {"type": "integer"},
                         "bio": {"type": "string", "minLength": 4000}}}
SPEC = {"type": "json_schema", "schema": SCHEMA}
TARGET_COST = 0.10


class _Timed:
    """Wraps the engine's grammar calls and adds up their time."""

    def __init__(self):
        self.seconds = 0.0
        self.mask, self.accept = engine_module.grammar_mask, engine_module.grammar_accept

    def install(self):
        def timed(fn):
            def call(*args):
                t0 = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    self.seconds += time.perf_counter() - t0
            return call
        engine_module.grammar_mask, engine_module.grammar_accept = timed(self.mask), timed(self.accept)


def decode(engine: Engine, prompts, new_tokens: int, spec, timer: _Timed) -> dict:
    tag = time.monotonic_ns()
    seqs = [engine.add_request(f"bench-{tag}-{i}", p, SamplingParams(max_tokens=new_tokens, ignore_eos=True,
                                                                     structured=spec))
            for i, p in enumerate(prompts)]
    while any(s.status is not SeqStatus.RUNNING and not s.is_done for s in seqs):
        engine.step()
    n0, grammar0 = engine.num_decode_tokens, timer.seconds
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    dt = time.perf_counter() - t0
    tokens = engine.num_decode_tokens - n0
    for s in seqs:
        assert s.status is SeqStatus.FINISHED and s.finish_reason == "length", (s, s.finish_reason)
        engine.seqs.pop(s.request_id, None)
    return dict(tok_s=tokens / dt, seconds=dt, grammar_s=timer.seconds - grammar0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small smoke run (8 prompts, 16 tokens, 1 round)")
    parser.add_argument("--threads", type=int, help="torch threads (default: all CPUs)")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    if args.threads:
        threads_set(args.threads)
    n, hi, new_tokens = (8, 128, 16) if args.quick else (32, 256, 64)
    started = time.perf_counter()
    model = load_model()
    prompts = chat_prompts(model.tokenizer, n, 16, hi, seed=0)
    pages = sum(cdiv(len(p) + new_tokens, 16) for p in prompts)
    engine = Engine(model, EngineConfig(num_pages=max(1024, pages + 64), max_num_seqs=max(64, n)))
    timer = _Timed()
    timer.install()
    compiler_for(model.tokenizer, model.config.vocab_size).compile(SPEC)
    decode(engine, prompts[:2], 4, SPEC, timer)  # warm-up, both paths
    decode(engine, prompts[:2], 4, None, timer)
    log(f"bench.grammar: {n} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, {new_tokens} new "
        f"tokens each, {repeats} rounds, {torch.get_num_threads()} threads, device {engine.device}")
    runs = {"plain": [], "grammar": [], "share": []}
    for r in range(repeats):
        first, second = (("plain", None), ("grammar", SPEC)) if r % 2 == 0 else (("grammar", SPEC), ("plain", None))
        for name, spec in (first, second):
            res = decode(engine, prompts, new_tokens, spec, timer)
            runs[name].append(res["tok_s"])
            if spec is not None:
                runs["share"].append(res["grammar_s"] / res["seconds"])
        log(f"round {r + 1}/{repeats}: plain {runs['plain'][-1]:.1f} tok/s, grammar {runs['grammar'][-1]:.1f} tok/s, "
            f"mask share {runs['share'][-1]:.3f} ({time.perf_counter() - started:.0f}s)")
    ratio = median([g / p for g, p in zip(runs["grammar"], runs["plain"])])
    result = dict(decode_tok_s_plain=median(runs["plain"]), decode_tok_s_grammar=median(runs["grammar"]),
                  ratio_grammar=ratio, mask_cost=1 - ratio, mask_share=median(runs["share"]),
                  target_mask_cost=TARGET_COST, meets_target=(1 - ratio) <= TARGET_COST,
                  num_seqs=n, new_tokens=new_tokens, repeats=repeats, quick=args.quick,
                  threads=torch.get_num_threads(), device=engine.device, seconds=round(time.perf_counter() - started, 1),
                  runs={k: [round(x, 4) for x in v] for k, v in runs.items()})
    print_table([dict(figure=f"decode tok/s, {n} sequences", plain=result["decode_tok_s_plain"],
                      json_schema=result["decode_tok_s_grammar"], ratio=ratio, mask_cost=1 - ratio,
                      target=f"<= {TARGET_COST}")],
                title=f"bench.grammar: medians of {repeats} interleaved rounds")
    emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
