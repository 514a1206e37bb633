"""The CUDA attention path, checked on a GPU in one go: the xformers backend (one call per step over
every sequence's block table) against the SDPA reference on random block tables (null-page
padding, partial last pages, decode rows, continued and fresh chunks, GQA and MHA), in fp32 (the
gathered, block-diagonal variant) and bf16/fp16 (the paged variant reading the pool in place); then
the same greedy tokens from both backends on the real model, and a short decode throughput run.

    python -m bench.cuda_check [--quick]

Imports nothing CUDA-specific at module import (safe on a CPU-only machine; there it reports
{"cuda": false} and exits 0). Ends with one JSON line.
"""
import argparse
import time
import traceback

import torch

from bench.common import emit_json, log
from inference.arith import cdiv

SHAPES = [(9, 3, 64), (4, 2, 16), (4, 4, 32), (8, 1, 128), (8, 8, 64)]


def kernel_cases(device, dtype) -> dict:
    from inference.attention import BACKENDS, AttentionBatch, SeqBatch
    from tests.inference.test_attention import random_case

    worst, cases = 0.0, 0
    for h, kvh, d in SHAPES:
        for page_size in (16, 32):
            for seed in range(2):
                pool, batch, q, k, v = random_case(h, kvh, d, page_size=page_size, seed=seed, num_pages=160)
                # the xformers backend attends over every sequence, fresh chunks included (the runner
                # does this on CUDA): fold the fresh chunks into `paged` with their own pages
                pool.data = pool.data.nan_to_num(0.0).to(device=device, dtype=dtype)
                sb = batch.paged
                qlens, starts, lens = list(sb.qlens), list(sb.starts), list(sb.lens)
                tables = sb.tables.tolist()
                width = len(tables[0])
                for f in batch.fresh:
                    n = f.num_rows
                    pages = [p for p in range(pool.num_pages) if all(p not in t for t in tables)][: cdiv(n, page_size)]
                    for j in range(n):  # write the fresh chunk's K/V where the runner would have
                        pool.data[pages[j // page_size], :, 0, j % page_size] = k[f.row_start + j].to(device, dtype)
                        pool.data[pages[j // page_size], :, 1, j % page_size] = v[f.row_start + j].to(device, dtype)
                    tables.append(pages + [pool.null_page] * (width - len(pages)))
                    qlens.append(n)
                    starts.append(f.row_start)
                    lens.append(n)
                order = sorted(range(len(starts)), key=lambda i: starts[i])
                tables, qlens, starts, lens = ([x[i] for i in order] for x in (tables, qlens, starts, lens))
                i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
                full = AttentionBatch(batch.slot_pages, batch.slot_offsets,
                                      paged=SeqBatch(i32(tables), i32(lens), i32(starts), i32(qlens), lens, starts, qlens),
                                      page_size=page_size, null_page=pool.null_page)
                qd, kd, vd = (x.to(device=device, dtype=dtype) for x in (q, k, v))
                for layer in range(pool.num_layers):
                    ours = BACKENDS["xformers"](qd.contiguous(), kd, vd, pool, layer, full)
                    ref = BACKENDS["sdpa"](qd, kd, vd, pool, layer,
                                           AttentionBatch(**{**full.__dict__, "cache": {}}))
                    worst = max(worst, (ours.float() - ref.float()).abs().max().item())
                    cases += 1
    return dict(cases=cases, max_abs_diff=worst)


def engine_checks(quick: bool) -> dict:
    from bench.common import chat_prompts
    from inference.engine import Engine, EngineConfig
    from inference.loader import load_model
    from inference.sequence import SamplingParams, SeqStatus

    model = load_model()
    prompts = chat_prompts(model.tokenizer, 8 if quick else 32, 16, 128 if quick else 512, seed=0)
    new = 16 if quick else 64
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    out, rates = {}, {}
    for backend in ("xformers", "sdpa"):
        engine = Engine(model, EngineConfig(num_pages=4096, device="cuda", attention=backend, max_num_seqs=64))
        out[backend] = [s.output_ids for s in engine.generate(prompts[:4], SamplingParams(max_tokens=16, ignore_eos=True))]
        seqs = [engine.add_request(f"c{i}", p, params) for i, p in enumerate(prompts)]
        while any(s.status is not SeqStatus.RUNNING and not s.is_done for s in seqs):
            engine.step()
        torch.cuda.synchronize()
        n0, t0 = engine.num_decode_tokens, time.perf_counter()
        while engine.has_work:
            engine.step()
        torch.cuda.synchronize()
        rates[backend] = (engine.num_decode_tokens - n0) / (time.perf_counter() - t0)
    return dict(tokens_match=out["xformers"] == out["sdpa"], decode_tok_s_xformers=rates["xformers"],
                decode_tok_s_sdpa=rates["sdpa"], ratio_xformers_vs_sdpa=rates["xformers"] / rates["sdpa"],
                num_prompts=len(prompts), new_tokens=new)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_check", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    result = dict(cuda=torch.cuda.is_available())
    if not result["cuda"]:
        log("no CUDA device: nothing to check")
        emit_json(result)
        return 0
    result["device"] = torch.cuda.get_device_name()
    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).split(".")[-1]
        try:
            res = kernel_cases(torch.device("cuda"), dtype)
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            res["ok"] = res["max_abs_diff"] < tol
            ok &= res["ok"]
            result[f"kernel_{name}"] = res
            log(f"xformers vs sdpa, {name}: {res}")
        except Exception as exc:
            ok = False
            result[f"kernel_{name}"] = dict(ok=False, error=f"{type(exc).__name__}: {exc}")
            log(traceback.format_exc())
    try:
        result["engine"] = engine_checks(args.quick)
        ok &= result["engine"]["tokens_match"]
        log(f"engine: {result['engine']}")
    except Exception as exc:
        ok = False
        result["engine"] = dict(error=f"{type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    result["ok"] = ok
    emit_json(result)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
