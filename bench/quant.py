"""w4a8's matmul (inference/native/quant.cpp) against the dense kernels on the model's own shapes, side by side:

    python -m bench.quant [--rows 1,4,8,32] [--repeats 15] [--threads N] [--quick]

One decode step's products (every layer's fused qkv, o, gate_up and down, and the lm_head; SmolLM2-135M's
shapes from the served model's config, each layer its own weights, as a model's working set is) at each row count,
timed in interleaved rounds for: fp32 oneDNN prepacked, bf16 oneDNN prepacked (where this CPU prepacks it), int4w
(torch's int4pack kernel, bf16 activations) and w4a8 (the file's Q4 blocks and the Q8_0 lm_head, int8
activations, in the widest layout this CPU runs: x16 with AVX-512 VNNI, x8 with AVX2), and beside it each narrower
w4a8 build: `w4a8-x8` (the AVX2 layout, where the CPU has AVX-512) and `w4a8-file` (the file's own layout with the
AVX2 loop). Weights are random codes in the file's formats: speed only. Prints ms per step's products and each
mode's ratio to fp32, then one JSON line.
"""
import argparse
import statistics
import time

import torch

from bench.common import emit_json, log, print_table
from inference import native, precision
from inference.loader import load_model
from inference.precision import (_coded_weight, _int4_weight, gemm_for, group8_quantize, group_quantize,
                                 model_shapes, onednn_bf16_prepacks)
from inference.threads import threads_set


def modes_for_this_cpu() -> list[str]:
    best = native.quant_isa("best")
    return (["fp32"] + (["bf16", "int4w"] if onednn_bf16_prepacks() else []) + ["w4a8"]
            + (["w4a8-x8"] if best == "avx512" else []) + (["w4a8-file"] if best in ("avx512", "avx2") else []))


def packed_products(mode: str, layers: list[list[torch.Tensor]], head: torch.Tensor):
    """(linear, [per layer: packed weights], packed head) of `mode`, its codes used at any row count (the row switch
    is what we measure)."""
    cpu = torch.device("cpu")
    gemm = gemm_for(mode.split("-")[0], cpu, "onednn")
    if mode == "int4w":
        dense = gemm_for("bf16", cpu, "onednn")
        return gemm.linear, [[_int4_weight(w, group_quantize(w), lambda t: None, 1 << 30) for w in ws]
                             for ws in layers], dense.pack(head)
    if mode.startswith("w4a8"):  # the layout is chosen when packing; the loop by the layout (the file's: avx2)
        native.quant_isa("avx2" if mode == "w4a8-x8" else "best")
        interleaved, precision.INTERLEAVED = precision.INTERLEAVED, {} if mode == "w4a8-file" else precision.INTERLEAVED
        try:
            return gemm.linear, [[_coded_weight(w, group_quantize(w), lambda t: None, 1 << 30) for w in ws]
                                 for ws in layers], _coded_weight(head, group8_quantize(head), lambda t: None, 1 << 30)
        finally:
            native.quant_isa("best")
            precision.INTERLEAVED = interleaved
    return gemm.linear, [[gemm.pack(w) for w in ws] for ws in layers], gemm.pack(head)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch and native threads (default: all CPUs)")
    parser.add_argument("--quick", action="store_true", help="two layers, 3 repeats")
    args = parser.parse_args(argv)
    if args.threads:
        threads_set(args.threads)
    if not native.fused_available():
        raise SystemExit(f"the native kernels are not built: {native.load_error()} (run `make install`)")
    config = load_model().config
    layers = 2 if args.quick else config.num_layers
    repeats = 3 if args.quick else args.repeats
    shapes = model_shapes(config)
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) / k ** 0.5 for n, k in shapes[:-1]] for _ in range(layers)]
    head = torch.randn(*shapes[-1], generator=gen) / shapes[-1][1] ** 0.5
    modes = modes_for_this_cpu()
    log(f"modes {modes}, {layers} layers, threads {torch.get_num_threads()}, w4a8 loop {native.quant_isa()}")
    with torch.inference_mode():
        packed = {m: packed_products(m, weights, head) for m in modes}
        rows_list = [int(r) for r in args.rows.split(",")]
        times = {(m, r): [] for m in modes for r in rows_list}
        for r in rows_list:
            xs = [torch.randn(r, k, generator=gen) for _, k in shapes]

            def step(mode):
                linear, per_layer, packed_head = packed[mode]
                t0 = time.perf_counter()
                for ws in per_layer:
                    for x, w in zip(xs[:-1], ws):
                        linear(x, w)
                linear(xs[-1], packed_head)
                return (time.perf_counter() - t0) * 1e3

            for m in modes:
                step(m)  # warm-up: oneDNN builds its primitives
            for _ in range(repeats):  # interleaved rounds: drift on a shared machine hits every mode alike
                for m in modes:
                    times[(m, r)].append(step(m))
    table, result = [], {"threads": torch.get_num_threads(), "native_threads": native.threads(), "layers": layers,
                         "w4a8_isa": native.quant_isa(), "modes": modes}
    for r in rows_list:
        base = statistics.median(times[("fp32", r)])
        row = {"rows": r}
        for m in modes:
            ms = statistics.median(times[(m, r)])
            row[f"{m}_ms"] = ms
            result[f"{m}_ms_rows{r}"] = round(ms, 3)
            if m != "fp32":
                row[f"{m}/fp32"] = base / ms
                result[f"ratio_{m}_vs_fp32_rows{r}"] = round(base / ms, 3)
        table.append(row)
    print_table(table, title="one decode step's products (ms, median; ratio = fp32 ms / mode ms, higher is faster)")
    emit_json(result)


if __name__ == "__main__":
    main()
