"""The greedy rows' argmax: torch.argmax against the native kernel (inference/native/fused.cpp argmax_rows), side
by side on the served model's vocabulary:

    python -m bench.argmax [--rows 1,8,32] [--repeats 200] [--threads N] [--quick]

Random fp32 logits [rows, vocab]; each round times both on the same tensor, interleaved; prints each one's median
us per call and the ratio torch / native (higher: the native one is faster), then one JSON line with the CPU's
flags."""
import argparse
import time

import torch

from bench.common import cpu_flags, emit_json, log, median, print_table
from inference import native
from inference.loader import load_model
from inference.threads import threads_set


def timed_us(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.argmax", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, help="torch's and the native kernels' threads (default: all CPUs)")
    parser.add_argument("--quick", action="store_true", help="20 repeats")
    args = parser.parse_args(argv)
    if not native.fused_available():
        raise SystemExit(f"the native kernels are not built: {native.load_error()} (run `make install`)")
    if args.threads:
        threads_set(args.threads)
    vocab = load_model().config.vocab_size
    repeats = 20 if args.quick else args.repeats
    rows_list = [int(r) for r in args.rows.split(",")]
    result, table = {}, []
    for rows in rows_list:
        x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
        if not torch.equal(native.argmax_rows(x), x.argmax(dim=-1)):
            raise SystemExit(f"argmax_rows differs from torch.argmax at {rows} rows")
        spent = {"torch": [], "native": []}
        for _ in range(repeats // 10):  # interleaved rounds of 10 calls each
            spent["torch"] += timed_us(lambda: x.argmax(dim=-1), 10)
            spent["native"] += timed_us(lambda: native.argmax_rows(x), 10)
        t, n = median(spent["torch"]), median(spent["native"])
        result |= {f"torch_us_rows{rows}": round(t, 2), f"native_us_rows{rows}": round(n, 2),
                   f"ratio_rows{rows}": round(t / n, 2)}
        table.append(dict(rows=rows, torch_us=t, native_us=n, torch_over_native=t / n))
    print_table(table, title=f"bench.argmax: [rows, {vocab}] fp32, median us per call, {torch.get_num_threads()} "
                             f"threads")
    log(f"native argmax isa: {native.quant_isa()} (the widest loop this CPU runs under ATEN_CPU_CAPABILITY)")
    emit_json(dict(bench="argmax", vocab=vocab, threads=torch.get_num_threads(), repeats=repeats,
                   cpu_flags=cpu_flags(), **result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
