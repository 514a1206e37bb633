"""Runs every benchmark module that exists and records what each reports.

    python -m bench.all [--quick] [--repeats N] [--url http://host:port] [--only engine,guards]
    python -m bench.all --render-only      # rebuild bench/RESULTS.md from bench/results.jsonl

Each run in MODULES is `python -m bench.<name>` in its own process, with the options RUNS gives it (the engine
and the profile in the precision `make run` serves, `auto`; `profile-c1` is that profile of one sequence, `peer-c1`
bench.peer with one client); its final stdout line is its JSON result. --quick / --repeats / --url / --api-key are
passed on to the modules whose source defines that option. A module that is not there, or fails to import, is skipped with a
message; `load` runs only when --url is given, `peer` only once llama.cpp's server is installed
(`python -m bench.peer --install-only`; otherwise reported as skipped with that command).

Results go to bench/results.jsonl (one line per module) and bench/RESULTS.md (a markdown table per
module, regenerated from the jsonl; everything from the NOTES marker on is written by hand and
kept). A full run overwrites results.jsonl; with --only, the lines of
the modules run are replaced and the others kept.
"""
import argparse
import datetime
import importlib
import importlib.util
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS_JSONL = HERE / "results.jsonl"
RESULTS_MD = HERE / "RESULTS.md"

MODULES = ["engine", "profile", "profile-c1", "attention", "quant", "argmax", "guards", "grammar", "ondemand", "prefix", "transport",
           "load", "fairness", "chaos", "memory", "peer", "peer-c1"]  # run in this order
# runs that are not a module's defaults: name -> (module, its options). The engine's figures are those of the
# precision `make run` serves (auto), not the modules' fp32 default (HF's own math, for contrast)
RUNS = {"engine": ("engine", ["--precision", "auto"]), "profile": ("profile", ["--precision", "auto"]),
        "profile-c1": ("profile", ["--precision", "auto", "--seqs", "1", "--steps", "30"]),
        "peer-c1": ("peer", ["--clients", "1"])}
NEEDS_URL = {"load"}
NEEDS_ROOT = {"chaos"}  # network namespaces
# opt-in: runs only once its peer is installed (`python -m bench.peer --install-only`, ~20 min of compiling)
NEEDS_PEER = {"peer", "peer-c1"}


def run_of(name: str) -> tuple[str, list[str]]:
    """The module a run name executes and the options it always passes."""
    return RUNS.get(name, (name, []))


def load(name: str):
    """(module, None) when bench.<name> imports; otherwise (None, why not)."""
    if importlib.util.find_spec(f"bench.{name}") is None:
        return None, "not present"
    try:
        return importlib.import_module(f"bench.{name}"), None
    except Exception as exc:  # a broken module is skipped, not fatal
        return None, f"does not import: {type(exc).__name__}: {exc}"


def options_for(module, given: dict[str, object]) -> list[str]:
    """The given options this module's argument parser defines (flags with True, others with a value)."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        source = ""
    out = []
    for option, value in given.items():
        if value in (None, False) or f'"{option}"' not in source:
            continue
        out += [option] if value is True else [option, str(value)]
    return out


def run_module(name: str, extra: list[str]) -> dict:
    module, fixed = run_of(name)
    cmd = [sys.executable, "-m", f"bench.{module}", *fixed, *extra]
    print(f"\n=== bench.{name}: {' '.join(cmd[1:])}", flush=True)
    started = time.perf_counter()
    last = ""
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        for line in proc.stdout:  # stream it through; stderr goes straight to ours
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                last = line.strip()
        rc = proc.wait()
    record = {"module": name, "finished_at": datetime.datetime.now().isoformat(timespec="seconds"),
              "wall_s": round(time.perf_counter() - started, 1)}
    try:
        result = json.loads(last)
        if not isinstance(result, dict):
            raise ValueError("not an object")
    except ValueError:
        record["error"] = f"exit {rc}; last line is not a JSON object: {last[:200]!r}"
        return record
    if rc:
        record["exit_code"] = rc
    return {**record, **result}


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}" if abs(value) >= 0.1 else f"{value:.2g}"
    if isinstance(value, (dict, list)):
        return "`" + json.dumps(value, separators=(",", ":")) + "`"
    return "" if value is None else str(value).replace("|", "\\|")


NOTES = "<!-- notes: written by hand below this line; python -m bench.all keeps them -->"


def hand_notes() -> str:
    """The hand-written part of RESULTS.md (from the NOTES marker on), or nothing."""
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
    return text[text.index(NOTES):] if NOTES in text else ""


def render_markdown(records: list[dict]) -> str:
    lines = ["# Benchmark results", "",
             f"Generated by `python -m bench.all` from `bench/results.jsonl` on {platform.node() or 'this host'} "
             f"({os.cpu_count()} CPUs, Python {platform.python_version()}). Each module's own docstring says how "
             "it measures; ratios are kvserve/baseline or on/off (higher is better).", ""]
    for rec in records:
        lines += [f"## bench.{rec.get('module', '?')}", ""]
        if "error" in rec:
            lines += [f"**failed**: {rec['error']}", ""]
            continue
        if "scenarios" in rec:  # bench.chaos: one row per scenario
            lines += chaos_table(rec) + [""]
            rec = {k: v for k, v in rec.items() if k != "scenarios"}
        lines += ["| metric | value |", "|---|---|"]
        first = sorted(k for k in rec if k.startswith("ratio_"))
        rest = sorted(k for k in rec if k not in first and k != "module")
        lines += [f"| {k} | {_cell(rec[k])} |" for k in first + rest]
        lines.append("")
    notes = hand_notes()
    return "\n".join(lines) + ("\n" + notes if notes else "")


CHAOS_COLUMNS = ("scenario", "done", "failed (codes)", "lost", "longest to terminal (s)", "foreign sightings",
                 "false critical incidents", "stranded pages", "integrity", "serving again (s)", "pass")


def chaos_table(rec: dict) -> list[str]:
    """bench.chaos's scenarios as a markdown table (targets: 0 lost, 0 foreign, 0 false critical, 0 stranded,
    integrity ok, serving again <= 30 s)."""
    def seconds(value):
        return "never" if value is None else f"{value:.1f}"

    lines = ["| " + " | ".join(CHAOS_COLUMNS) + " |", "|" + "---|" * len(CHAOS_COLUMNS)]
    for name in rec.get("order") or rec["scenarios"]:
        f = rec["scenarios"][name]
        codes = ", ".join(f"{c} {n}" for c, n in sorted(f.get("failed_codes", {}).items()))
        cells = [f"`{name}`", f["done"], f"{f['failed']}" + (f" ({codes})" if codes else ""), f["lost"],
                 seconds(f.get("max_terminal_s")), f["foreign_sightings"], f["false_critical_incidents"],
                 f["stranded_pages"], "ok" if f["integrity"] == "ok" else "FAIL: " + f["integrity"],
                 seconds(f.get("serve_again_s")), "yes" if f["passed"] else "no: " + ", ".join(f["checks_failed"])]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


README = ROOT / "README.md"
BEGIN, END = "<!-- bench:begin (generated by python -m bench.all) -->", "<!-- bench:end -->"
# (module, key, what it is, target) for the README's summary table
SUMMARY = [
    ("engine", "ratio_decode_c32", "decode, 32 concurrent, vs HF batched generate", ">= 2.5"),
    ("engine", "ratio_decode_c1", "decode, single stream, vs HF", ">= 1.5"),
    ("engine", "ratio_prefill", "prefill of a 500-token prompt, vs HF", ">= 2.0"),
    ("profile", "step_ms_median", "one 32-sequence decode step (ms)", ""),
    ("profile", "fraction_attention", "share of that step in attention", ""),
    ("profile-c1", "step_over_matmul", "one sequence's decode step over its matmul time", "<= 1.5"),
    ("attention", "kernel_fraction_bfloat16", "paged-attention kernel's share of a 32 x 512-token decode step "
     "(bf16 pool)", "<= 0.18"),
    ("attention", "fraction_floor_bfloat16", "the same share for a kernel reading at a plain read's rate", ""),
    ("attention", "fraction_floor_pages_bfloat16", "the same share for a kernel reading its scattered pages as fast as "
     "they read with no attention", ""),
    ("attention", "kernel_share_of_page_read_bfloat16", "the kernel's rate over that read's (1.0: bound by reading its "
     "pages)", ""),
    ("quant", "ratio_w4a8_vs_fp32_rows1", "one row's decode-step products, fp32 ms / w4a8 ms", ""),
    ("argmax", "ratio_rows32", "greedy argmax over 32 rows of the vocabulary, torch / native", ""),
    ("guards", "ratio_guards_on_vs_off", "throughput, ownership guards on / off", ">= 0.97"),
    ("guards", "ratio_scrub_on_vs_off", "throughput, scrub on free on / off", ">= 0.99"),
    ("guards", "ratio_on_vs_on_again", "throughput, guards and scrub on / the same again (A/A: this run's noise)", ""),
    ("guards", "scrub_time_fraction", "share of a run's time inside the scrub (instrumented)", "<= 0.01"),
    ("guards", "ledger_allocate_p50_us", "Redis ledger allocate p50 (us)", ""),
    ("guards", "ledger_free_p50_us", "Redis ledger free p50 (us)", ""),
    ("grammar", "mask_cost", "decode cost of a JSON-schema token mask on every one of 32 sequences", "<= 0.10"),
    ("ondemand", "ratio_concurrent_median", "concurrent sequences, pages on demand / reserve-whole (EOS workload)",
     ">= 2.0"),
    ("ondemand", "ratio_tok_s", "throughput, pages on demand / reserve-whole (EOS workload)", ""),
    ("prefix", "speedup_turns_2_on_min", "TTFT of conversation turns 2-10, no prefix cache / cache (slowest turn)",
     ">= 3"),
    ("prefix", "auc_cross_tenant", "side channel: ROC AUC of another tenant's TTFT probes (sent vs not)", "<= 0.6"),
    ("prefix", "auc_same_tenant", "side channel: ROC AUC of the same probes within the tenant (power)", ">= 0.9"),
    ("transport", "ratio_transfer_vs_prefill", "KV transfer time / prefill time, 512 tokens", "<= 0.25"),
    ("load", "errors", "load test errors (32 clients)", "0"),
    ("load", "lost", "load test requests without an answer", "0"),
    ("load", "incidents", "incidents opened during the load test", "0"),
    ("load", "ratio_vs_engine", "load tok/s over the in-process engine's", ">= 0.85"),
    ("peer", "ratio_tok_s", "tok/s, kvserve's stack / llama.cpp's server, 32 clients", ">= 2.0"),
    ("peer-c1", "ratio_tok_s", "tok/s, kvserve's stack / llama.cpp's server, one client", ">= 1.0"),
    ("fairness", "ttft_ratio", "tenant B's TTFT while A floods / alone (fair share on)", "<= 2"),
    ("fairness", "completion_ratio", "tenant B's completion time while A floods / alone", "<= 2"),
    ("fairness", "unlimited_ttft_ratio", "the same TTFT ratio with A's limits off (contrast)", ""),
    ("fairness", "ttft_added_ms", "what A's flood adds to B's TTFT under fair share (ms)", ""),
    ("chaos", "passed", "chaos suite: every target met in every scenario (table below)", "True"),
]


def render_readme_table(records: list[dict]) -> str:
    by_module = {r.get("module") or r.get("bench"): r for r in records}
    lines = [BEGIN, "| benchmark | figure | target | measured |", "| --- | --- | --- | --- |"]
    for name, key, what, target in SUMMARY:
        rec = by_module.get(name)
        if rec and key in rec:
            module, fixed = run_of(name)
            command = " ".join([f"bench.{module}", *fixed])
            lines.append(f"| `{command}` {what} | {_cell(rec[key])} | {target} | {measured(rec)} |")
    return "\n".join(lines + [END])


def measured(rec: dict) -> str:
    """When and under what a record was taken: its date, the precision it ran and whether the CPU had AVX-512 / AMX
    (figures move with the machine: bench/RESULTS.md has each one's CPU)."""
    flags = set(rec.get("cpu_flags") or ())
    isa = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    precision = rec.get("precision") or (rec.get("kvserve_precision") or {}).get("decode") or ""
    parts = [str(rec.get("finished_at", ""))[:10], precision, isa]
    return ", ".join(p for p in parts if p)


CHAOS_BEGIN, CHAOS_END = "<!-- chaos:begin (generated by python -m bench.all) -->", "<!-- chaos:end -->"


def write_readme_table(records: list[dict]) -> None:
    """Replaces the marked tables in README.md; leaves a table alone when its markers are missing."""
    text = README.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + render_readme_table(records) + rest.split(END, 1)[1]
    chaos = next((r for r in records if "scenarios" in r), None)
    if chaos and CHAOS_BEGIN in text and CHAOS_END in text:
        head, rest = text.split(CHAOS_BEGIN, 1)
        note = [f"Measured at {chaos.get('code', '?')}: {chaos['note']}", ""] if chaos.get("note") else []
        text = head + "\n".join([CHAOS_BEGIN, *note, *chaos_table(chaos), CHAOS_END]) + rest.split(CHAOS_END, 1)[1]
    README.write_text(text)


def write_results(records: list[dict]) -> None:
    RESULTS_JSONL.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    RESULTS_MD.write_text(render_markdown(records))
    write_readme_table(records)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.all", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every module")
    parser.add_argument("--repeats", type=int, help="pass --repeats N to every module")
    parser.add_argument("--url", help="base URL of a running deployment (enables bench.load)")
    parser.add_argument("--api-key", help="API key for --url (bench.load)")
    parser.add_argument("--only", help="comma-separated module names (default: all of MODULES)")
    parser.add_argument("--render-only", action="store_true", help="only rebuild RESULTS.md from results.jsonl")
    args = parser.parse_args(argv)
    if args.render_only:
        records = [json.loads(line) for line in RESULTS_JSONL.read_text().splitlines() if line.strip()]
        RESULTS_MD.write_text(render_markdown(records))
        write_readme_table(records)
        print(f"wrote {RESULTS_MD} and the README's summary table")
        return 0

    wanted = args.only.split(",") if args.only else MODULES
    records, failed = [], False
    if args.only and RESULTS_JSONL.exists():  # a partial run updates those modules' lines, keeps the rest
        records = [r for r in map(json.loads, RESULTS_JSONL.read_text().splitlines()) if r.get("module") not in wanted]
    for name in wanted:
        if name in NEEDS_URL and not args.url:
            print(f"skip bench.{name}: needs --url", flush=True)
            continue
        if name in NEEDS_ROOT and os.geteuid() != 0:
            print(f"skip bench.{name}: needs root", flush=True)
            continue
        module, why = load(run_of(name)[0])
        if why:
            print(f"skip bench.{name}: {why}", flush=True)
            continue
        if name in NEEDS_PEER and module.server_binary() is None:
            print(f"skip bench.{name}: {module.SKIPPED}", flush=True)
            continue
        extra = options_for(module, {"--quick": args.quick, "--repeats": args.repeats, "--url": args.url,
                                     "--api-key": args.api_key})
        record = run_module(name, extra)
        failed |= "error" in record
        records.append(record)
        write_results(records)  # keep what finished even if a later module dies
    order = {name: i for i, name in enumerate(MODULES)}
    records.sort(key=lambda r: order.get(r.get("module"), len(order)))
    write_results(records)
    print(f"\nwrote {RESULTS_JSONL.relative_to(ROOT)} and {RESULTS_MD.relative_to(ROOT)} ({len(records)} modules)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
