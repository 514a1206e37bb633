"""kvserve against Hugging Face transformers on the same GGUF, same prompts, one process, one run.

    python -m bench.engine [--repeats 3] [--quick] [--precision fp32[,bf16,fp16w,auto]]

Both sides load the same file (`inference.loader.resolve_model_path()`) and run it in float32 on
the CPU with the same thread count. Each round runs every measurement of both systems, interleaved
(kvserve prefill, HF prefill, kvserve c1, HF b1, kvserve c32, HF b32); tok/s figures are medians
over `--repeats` rounds, and each ratio is the median over rounds of that round's kvserve/HF ratio,
so that a burst of load from other processes (this machine is shared) spoils one pair, not a median.

Workload
  * c32/b32: 32 chat prompts (chat template applied) of deterministic mixed lengths spread over
    16..512 tokens, each with a deterministic 64..128 new tokens (ignore_eos: lengths are fixed).
  * c1/b1: one ~256-token chat prompt, 64 new tokens.
  * prefill: one 500-token chat prompt, time to first token (max_tokens=1).
  `--quick` shrinks everything (8 prompts of 16..128 tokens, 8..16 new tokens, 1 round) for smoke runs.

How decode tok/s excludes prefill
  * kvserve: all requests are added, then the engine steps until every request is RUNNING (its
    prefill is done and its first token sampled). Only then the clock starts; it runs the remaining
    steps to completion and counts the tokens sampled in them (`engine.num_decode_tokens`). The
    batch shrinks at the end as requests reach their own max_tokens: that tail is included.
  * HF: one batched `generate` (left padding + attention mask, greedy, min_new_tokens =
    max_new_tokens = N so no row stops early) with a LogitsProcessor that only records a timestamp.
    It is called once per generated token, right after that step's forward pass: the first call
    closes the prefill, so decode time = last stamp - first stamp, covering N-1 decode forwards
    (and their sampling) for every row. A static batch runs until its longest request is done, so
    N = the largest max_tokens (128) for every row. `hf_decode_tok_s_b32` counts every token HF
    generates, rows * (N-1) (HF's raw rate, the conservative baseline the ratio uses);
    `hf_goodput_tok_s_b32` counts only the tokens the requests asked for, sum(max_tokens_i - 1),
    which is what kvserve's figure counts (`ratio_decode_c32_goodput`).
  * prefill tok/s = prompt tokens / time to first token (kvserve: add_request + steps until the
    first token; HF: generate with max_new_tokens=1). A prefill takes a fraction of a second, so each
    round runs `--prefill-pairs` (5) of them, kvserve and HF alternately; the round's figure is the median
    of its prefills, and ratio_prefill the median of every pair's kvserve/HF ratio.

Precision (`--precision`, inference.precision): the first mode listed is "kvserve" in every figure and
ratio above; each further mode gets its own engine on the same LoadedModel, measured in the same rounds
right after the first (prefill, c1, c32), reported as kvserve_*_<mode> and speedup_*_<mode> (the median
over rounds of that round's <mode> / first-mode ratio).

Ends with one JSON line (see `emit_json`): kvserve_*, hf_* figures and the ratios kvserve/HF.
"""
import argparse
import gc
import random
import time

import torch

from bench.common import chat_prompts, emit_json, log, median, print_table
from inference.engine import Engine, EngineConfig
from inference.kv_cache import cdiv
from inference.loader import load_model, resolve_model_path
from inference.sequence import SamplingParams, SeqStatus
from inference.threads import threads_set

# issue 23's targets for kvserve / HF transformers on the same CPU (the JSON line says which are met)
TARGETS = {"ratio_decode_c32": 2.5, "ratio_decode_c1": 1.5, "ratio_prefill": 2.0}


def workload(tokenizer, quick: bool):
    if quick:
        n, lo, hi, tmin, tmax, c1_len, c1_new, prefill_len = 8, 16, 128, 8, 16, 64, 8, 128
    else:
        n, lo, hi, tmin, tmax, c1_len, c1_new, prefill_len = 32, 16, 512, 64, 128, 256, 64, 500
    prompts = chat_prompts(tokenizer, n, lo, hi, seed=0)
    rng = random.Random(1)
    max_tokens = [rng.randint(tmin, tmax) for _ in prompts]
    c1_prompt = chat_prompts(tokenizer, 1, c1_len, c1_len, seed=2)[0]
    prefill_prompt = chat_prompts(tokenizer, 1, prefill_len, prefill_len, seed=3)[0]
    return dict(prompts=prompts, max_tokens=max_tokens, c1_prompt=c1_prompt, c1_new=c1_new,
                prefill_prompt=prefill_prompt)


# ---- kvserve -------------------------------------------------------------------------------

def make_engine(model, prompts, max_tokens, precision: str = "fp32", kv_dtype: str = "auto") -> Engine:
    pages = sum(cdiv(len(p) + t, 16) for p, t in zip(prompts, max_tokens))
    return Engine(model, EngineConfig(num_pages=max(1024, pages + 64), page_size=16, chunk_size=512,
                                      max_num_seqs=max(64, len(prompts)), precision=precision, kv_dtype=kv_dtype))


def kvserve_decode(engine: Engine, prompts, max_tokens) -> dict:
    tag = time.monotonic_ns()
    seqs = [engine.add_request(f"bench-{tag}-{i}", p, SamplingParams(max_tokens=t, ignore_eos=True))
            for i, (p, t) in enumerate(zip(prompts, max_tokens))]
    while any(s.status is not SeqStatus.RUNNING and not s.is_done for s in seqs):
        engine.step()
    n0, steps = engine.num_decode_tokens, 0
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    tokens = engine.num_decode_tokens - n0
    for s in seqs:
        assert s.status is SeqStatus.FINISHED, s
        engine.seqs.pop(s.request_id, None)
    return dict(tok_s=tokens / dt, tokens=tokens, seconds=dt, steps=steps)


def kvserve_prefill(engine: Engine, prompt) -> dict:
    t0 = time.perf_counter()
    seq = engine.add_request(f"bench-prefill-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not seq.output_ids:
        engine.step()
    dt = time.perf_counter() - t0
    while engine.has_work:
        engine.step()
    engine.seqs.pop(seq.request_id, None)
    return dict(tok_s=len(prompt) / dt, seconds=dt)


# ---- Hugging Face ----------------------------------------------------------------------------

def load_hf():
    import transformers

    path = resolve_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


class _Stamps:
    """A LogitsProcessor that changes nothing and records when each step's logits arrive."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_generate(model, prompts, new_tokens: int, pad_id: int) -> dict:
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stamps = _Stamps()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                             logits_processor=LogitsProcessorList([stamps]))
    total = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens, out.shape
    first = stamps.times[0] - t0
    decode = stamps.times[-1] - stamps.times[0]
    tokens = len(prompts) * (new_tokens - 1)
    return dict(ttft=first, total=total, decode_s=decode, decode_tok_s=tokens / decode if tokens else float("nan"))


def hf_b32(model, prompts, max_tokens, pad_id) -> dict:
    res = hf_generate(model, prompts, max(max_tokens), pad_id)
    res["goodput_tok_s"] = sum(t - 1 for t in max_tokens) / res["decode_s"]
    return res


# ---- main ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small smoke run (fewer prompts and tokens, 1 round)")
    parser.add_argument("--no-hf", action="store_true", help="kvserve only (ratios are then null)")
    parser.add_argument("--prefill-pairs", type=int, default=5,
                        help="prefills a round, kvserve and HF alternately (the round's figure: their median)")
    parser.add_argument("--threads", type=int, help="torch threads for both systems (default: all CPUs)")
    parser.add_argument("--precision", default="fp32",
                        help="comma-separated kvserve precisions (fp32, bf16, fp16w, auto); the first is compared "
                             "with HF, the others with the first")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.precision.split(",") if m.strip()]
    repeats = 1 if args.quick else args.repeats
    if args.threads:
        threads_set(args.threads)

    started = time.perf_counter()
    model = load_model()
    w = workload(model.tokenizer, args.quick)
    prompts, max_tokens = w["prompts"], w["max_tokens"]
    hf_new = max(max_tokens)
    pad_id = model.tokenizer.eos_ids[0] if model.tokenizer.eos_ids else 0
    log(f"bench.engine: {len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
        f"{min(max_tokens)}..{max(max_tokens)} new tokens (HF: {hf_new} each); c1 prompt {len(w['c1_prompt'])} "
        f"tokens + {w['c1_new']}; prefill prompt {len(w['prefill_prompt'])} tokens; {repeats} rounds; "
        f"{torch.get_num_threads()} threads")
    engine = make_engine(model, prompts, max_tokens, modes[0])
    others = {m: make_engine(model, prompts, max_tokens, m) for m in modes[1:]}
    log("precision: " + ", ".join(f"{m} -> {e.precision}" for m, e in [(modes[0], engine), *others.items()]))
    hf = None if args.no_hf else load_hf()
    log(f"models loaded in {time.perf_counter() - started:.1f}s")

    # warm-up: one short pass each, so first-call costs (allocations, kernels) are not measured
    kvserve_decode(engine, prompts[:2], [4, 4])
    kvserve_prefill(engine, w["prefill_prompt"][:64])
    for e in others.values():
        kvserve_decode(e, prompts[:2], [4, 4])
        kvserve_prefill(e, w["prefill_prompt"][:64])
    if hf is not None:
        hf_generate(hf, [w["c1_prompt"][:32]], 3, pad_id)

    runs = {k: [] for k in ("kv_prefill", "kv_c1", "kv_c32", "hf_prefill", "hf_b1", "hf_b32", "hf_b32_goodput",
                            *(f"kv_{f}_{m}" for m in others for f in ("prefill", "c1", "c32")))}
    prefill_pairs = 1 if args.quick else args.prefill_pairs
    prefill_ratios = []  # kvserve / HF of each prefill pair
    for r in range(repeats):
        gc.collect()
        kv_pf, hf_pf = [], []  # prefill pairs, back to back: a prefill is a fraction of a second, one sample is noise
        for _ in range(prefill_pairs):
            kv_pf.append(kvserve_prefill(engine, w["prefill_prompt"])["tok_s"])
            if hf is not None:
                hf_pf.append(len(w["prefill_prompt"]) / hf_generate(hf, [w["prefill_prompt"]], 1, pad_id)["ttft"])
        runs["kv_prefill"].append(median(kv_pf))
        if hf is not None:
            runs["hf_prefill"].append(median(hf_pf))
            prefill_ratios.extend(k / h for k, h in zip(kv_pf, hf_pf))
        runs["kv_c1"].append(kvserve_decode(engine, [w["c1_prompt"]], [w["c1_new"]])["tok_s"])
        if hf is not None:
            runs["hf_b1"].append(hf_generate(hf, [w["c1_prompt"]], w["c1_new"], pad_id)["decode_tok_s"])
        res = kvserve_decode(engine, prompts, max_tokens)
        runs["kv_c32"].append(res["tok_s"])
        if hf is not None:
            res = hf_b32(hf, prompts, max_tokens, pad_id)
            runs["hf_b32"].append(res["decode_tok_s"])
            runs["hf_b32_goodput"].append(res["goodput_tok_s"])
        for m, e in others.items():
            runs[f"kv_prefill_{m}"].append(median([kvserve_prefill(e, w["prefill_prompt"])["tok_s"]
                                                   for _ in range(prefill_pairs)]))
            runs[f"kv_c1_{m}"].append(kvserve_decode(e, [w["c1_prompt"]], [w["c1_new"]])["tok_s"])
            runs[f"kv_c32_{m}"].append(kvserve_decode(e, prompts, max_tokens)["tok_s"])
        log(f"round {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items() if v)
            + f" ({time.perf_counter() - started:.0f}s)")

    med = {k: median(v) for k, v in runs.items()}

    def ratio(a, b):
        """Median over rounds of the within-round ratio: a round runs both systems back to back, so a
        burst of load from other processes lands on one pair, not on one system's median."""
        pairs = [x / y for x, y in zip(runs[a], runs[b]) if y > 0]
        return median(pairs) if pairs else None

    result = dict(
        kvserve_decode_tok_s_c1=med["kv_c1"], kvserve_decode_tok_s_c32=med["kv_c32"],
        kvserve_prefill_tok_s_500=med["kv_prefill"],
        hf_decode_tok_s_b1=med["hf_b1"], hf_decode_tok_s_b32=med["hf_b32"], hf_prefill_tok_s_500=med["hf_prefill"],
        ratio_decode_c32=ratio("kv_c32", "hf_b32"), ratio_decode_c1=ratio("kv_c1", "hf_b1"),
        ratio_prefill=median(prefill_ratios) if prefill_ratios else None, prefill_pairs=prefill_pairs,
        hf_goodput_tok_s_b32=med["hf_b32_goodput"], ratio_decode_c32_goodput=ratio("kv_c32", "hf_b32_goodput"),
        repeats=repeats, quick=args.quick, threads=torch.get_num_threads(), num_prompts=len(prompts),
        prefill_prompt_tokens=len(w["prefill_prompt"]), seconds=round(time.perf_counter() - started, 1),
        runs={k: [round(x, 2) for x in v] for k, v in runs.items()},
        precision=engine.precision, precision_choice=engine.precision_choice.line(), kv_dtype=engine.kv_dtype,
    )
    # null where there is no ratio to judge (--no-hf), rather than a verdict either way
    result["targets_met"] = {k: None if result[k] is None else result[k] >= v for k, v in TARGETS.items()}
    for m, e in others.items():
        result.update({f"kvserve_decode_tok_s_c32_{m}": med[f"kv_c32_{m}"], f"kvserve_decode_tok_s_c1_{m}": med[f"kv_c1_{m}"],
                       f"kvserve_prefill_tok_s_500_{m}": med[f"kv_prefill_{m}"],
                       f"speedup_decode_c32_{m}": ratio(f"kv_c32_{m}", "kv_c32"),
                       f"speedup_decode_c1_{m}": ratio(f"kv_c1_{m}", "kv_c1"),
                       f"speedup_prefill_{m}": ratio(f"kv_prefill_{m}", "kv_prefill"),
                       f"precision_{m}": e.precision_choice.line(), f"kv_dtype_{m}": e.kv_dtype})
    rows = [
        dict(figure=f"decode tok/s, {len(prompts)} concurrent", kvserve=med["kv_c32"], hf=med["hf_b32"],
             ratio=result["ratio_decode_c32"], target=TARGETS["ratio_decode_c32"]),
        dict(figure=f"  same, HF counting only requested tokens", kvserve=med["kv_c32"], hf=med["hf_b32_goodput"],
             ratio=result["ratio_decode_c32_goodput"], target="-"),
        dict(figure="decode tok/s, 1 stream", kvserve=med["kv_c1"], hf=med["hf_b1"], ratio=result["ratio_decode_c1"],
             target=TARGETS["ratio_decode_c1"]),
        dict(figure=f"prefill tok/s, {len(w['prefill_prompt'])}-token prompt", kvserve=med["kv_prefill"],
             hf=med["hf_prefill"], ratio=result["ratio_prefill"], target=TARGETS["ratio_prefill"]),
    ]
    for m, e in others.items():
        rows += [dict(figure=f"[{m} -> {e.precision}] decode tok/s, {len(prompts)} concurrent", kvserve=med[f"kv_c32_{m}"],
                      hf=None, ratio=result[f"speedup_decode_c32_{m}"], target=f"vs {modes[0]}"),
                 dict(figure=f"[{m}] decode tok/s, 1 stream", kvserve=med[f"kv_c1_{m}"], hf=None,
                      ratio=result[f"speedup_decode_c1_{m}"], target=f"vs {modes[0]}"),
                 dict(figure=f"[{m}] prefill tok/s", kvserve=med[f"kv_prefill_{m}"], hf=None,
                      ratio=result[f"speedup_prefill_{m}"], target=f"vs {modes[0]}")]
    print_table([{k: ("-" if v is None else v) for k, v in row.items()} for row in rows],
                title=f"bench.engine: medians of {repeats} interleaved rounds ({torch.get_num_threads()} threads)")
    emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
