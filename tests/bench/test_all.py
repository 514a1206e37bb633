"""bench.all's runs and the README's summary table: which options each run passes, and what a row says about when
and under what its figure was taken."""
from bench import all as bench_all


def test_runs_name_the_module_and_the_options_it_always_passes():
    assert bench_all.run_of("engine") == ("engine", ["--precision", "auto"])
    assert bench_all.run_of("peer-c1") == ("peer", ["--clients", "1"])
    assert bench_all.run_of("profile-c1") == ("profile", ["--precision", "auto", "--seqs", "1", "--steps", "30"])
    assert bench_all.run_of("guards") == ("guards", [])
    assert {bench_all.run_of(name)[0] for name in bench_all.MODULES} <= set(bench_all.MODULES)


def test_summary_rows_carry_the_command_date_precision_and_isa():
    records = [
        {"module": "engine", "finished_at": "2026-12-07T03:00:00", "precision": "w4a8", "ratio_decode_c1": 10.67,
         "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]},
        {"module": "peer-c1", "finished_at": "2026-12-06T01:00:00", "ratio_tok_s": 1.46,
         "kvserve_precision": {"decode": "w4a8", "prefill": "w4a8"},
         "cpu_flags": ["avx2", "avx512f", "amx_bf16"]},
        {"module": "guards", "finished_at": "2026-11-30T13:52:24", "ratio_guards_on_vs_off": 1.066,
         "cpu_flags": ["avx2"]},
    ]
    table = bench_all.render_readme_table(records)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| `")}
    c1 = rows["`bench.engine --precision auto` decode, single stream, vs HF"]
    assert "| 10.670 | >= 1.5 | 2026-12-07, w4a8, AVX-512 |" in c1
    peer = rows["`bench.peer --clients 1` tok/s, kvserve's stack / llama.cpp's server, one client"]
    assert "| 1.460 | >= 1.0 | 2026-12-06, w4a8, AMX |" in peer
    assert "2026-11-30, AVX2 |" in rows["`bench.guards` throughput, ownership guards on / off"]
    assert not any("decode, 32 concurrent" in r for r in rows)  # a figure no record holds gets no row
