"""Smoke test of the benchmark harness: `python -m bench.guards --quick` runs end to end against the
real model and Redis (DB 15, its own key prefix) and ends with one JSON line holding the figures
`bench.all` collects. No timing assertions: this machine is shared and noisy."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ("ratio_guards_on_vs_off", "ratio_scrub_on_vs_off", "ledger_allocate_p50_us", "ledger_allocate_p99_us",
            "ledger_free_p50_us", "ledger_free_p99_us")


def test_guards_quick_ends_with_one_json_line():
    proc = subprocess.run([sys.executable, "-m", "bench.guards", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    missing = [k for k in REQUIRED if k not in result]
    assert not missing, f"missing {missing} in {last}"
    for key in REQUIRED:
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])
    assert result["ledger_allocate_p50_us"] <= result["ledger_allocate_p99_us"]
    assert result["ledger_free_p50_us"] <= result["ledger_free_p99_us"]
    assert result["outputs_match"] is True


def test_ondemand_quick_ends_with_one_json_line_and_on_demand_holds_more_sequences():
    proc = subprocess.run([sys.executable, "-m", "bench.ondemand", "--quick", "--threads", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("ratio_concurrent_median", "ratio_concurrent_peak", "ratio_tok_s", "on_demand_median_running",
                "reserve_whole_median_running", "on_demand_tok_s", "reserve_whole_tok_s"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])
    # a count, not a timing: reserve-whole holds 3 of these requests in 64 pages, on demand every one that fits
    assert result["reserve_whole_peak_running"] == 3 and result["on_demand_peak_running"] > 3
    assert result["on_demand_stopped_at_eos"] == result["requests"] == 16
    assert result["outputs_match"] is True


def test_quant_quick_times_w4a8_beside_fp32_and_ends_with_one_json_line():
    proc = subprocess.run([sys.executable, "-m", "bench.quant", "--quick", "--rows", "1,8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "w4a8" in result["modes"] and result["w4a8_isa"] in ("avx512", "avx2", "generic")
    # the widest layout, and beside it each narrower one this CPU runs: x8 (AVX2) under AVX-512, the file's own under both
    assert ("w4a8-x8" in result["modes"]) == (result["w4a8_isa"] == "avx512")
    assert ("w4a8-file" in result["modes"]) == (result["w4a8_isa"] in ("avx512", "avx2"))
    for key in ("fp32_ms_rows1", "w4a8_ms_rows1", "w4a8_ms_rows8", "ratio_w4a8_vs_fp32_rows1"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])
    assert isinstance(result["cpu_flags"], list)


def test_argmax_quick_times_torchs_beside_the_native_one_and_ends_with_one_json_line():
    proc = subprocess.run([sys.executable, "-m", "bench.argmax", "--quick", "--rows", "1,4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "argmax" and result["vocab"] > 1000 and isinstance(result["cpu_flags"], list)
    for key in ("torch_us_rows1", "native_us_rows1", "ratio_rows4"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])


def test_engine_quick_without_hf_ends_with_one_json_line_and_null_ratios():
    proc = subprocess.run([sys.executable, "-m", "bench.engine", "--quick", "--no-hf", "--precision", "fp32"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("kvserve_decode_tok_s_c1", "kvserve_decode_tok_s_c32", "kvserve_prefill_tok_s_500"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])
    # nothing to compare with: every ratio and every target's verdict is null, not a crash and not a false "met"
    assert result["ratio_decode_c32"] is None and result["ratio_prefill"] is None and result["hf_decode_tok_s_b1"] is None
    assert result["targets_met"] == dict.fromkeys(("ratio_decode_c32", "ratio_decode_c1", "ratio_prefill"))
    assert result["precision"] == "fp32"
    assert result["prefill_pairs"] == 1  # --quick: one prefill a round (a full run: 5, alternating with HF's)


def test_attention_quick_times_the_pool_on_huge_and_on_4kb_pages_and_ends_with_one_json_line():
    proc = subprocess.run([sys.executable, "-m", "bench.attention", "--quick", "--no-step", "--kv-dtypes",
                           "bfloat16,int8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kv_dtypes"] == ["bfloat16", "int8"] and isinstance(result["cpu_flags"], list)
    best = result["isas"][-1]
    for d in ("bfloat16", "int8"):
        for key in (f"kernel_ms_{best}_{d}", f"kernel_ms_4k_{d}", f"speedup_hugepages_{d}", f"kernel_share_of_stream_{d}"):
            assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])
        # the pool the bench times is the engine's own PagePool: on huge pages wherever the kernel gives them
        assert result[f"huge_page_share_{d}"] > 0.5 or result["thp"] not in ("always", "madvise"), result
    assert result["stream_gb_s"] > 0  # the plain read the kernels' rates are set against
    for d in ("bfloat16", "int8"):  # and the pool's own pages read as the kernel walks them, with no attention
        assert result[f"page_read_gb_s_{d}"] > 0 and result[f"kernel_share_of_page_read_{d}"] > 0, result
    # the int8 pool's AVX-512 loop in one pass beside its default two
    assert ("speedup_int8_two_pass" in result) == (best == "avx512")
    if best == "avx512":
        assert result["kernel_ms_1pass_int8"] > 0 and result["speedup_int8_two_pass"] > 0
    # a fresh prompt's attention in every kind this CPU runs, torch's fp32 SDPA the yardstick, and the engine's pick
    assert result["fresh_ms_fp32"] > 0 and result["fresh_ms_sdpa-bf16"] > 0
    from inference import native

    assert ("fresh_ms_native-fp32" in result) == native.prefill_fp32_available()
    assert ("fresh_ms_native-bf16" in result) == native.prefill_bf16_available()
    assert result["fresh_pick"] in [k.removeprefix("fresh_ms_") for k in result if k.startswith("fresh_ms_")]
