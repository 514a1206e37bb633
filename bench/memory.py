"""Where a worker's RSS goes: a prefill/decode worker's pieces loaded one by one in this process, each
step's RSS delta (anonymous and file-backed apart, /proc/self/status), then the canary's self-test sandbox
run as the maintenance queue runs it (a thread of its own, in the worker's process) N times.

    python -m bench.memory [--num-pages 1024] [--canary-runs 3] [--prompt-tokens 2048]
                           [--sandbox-builds-model] [--no-release]

Steps: interpreter; torch; Django + the Celery app + the worker's modules; the tokenizer; the weights
(the fp32 safetensors cache, mmapped: file-backed pages, shared by every process on the host that maps
it); the model (q/k/v and gate/up fused, every projection and the tied lm_head prepacked for oneDNN: an
anonymous copy); the KV page pool (one tensor, K and V inside, pre-faulted) and the engine around it;
a warm-up request (prefill of --prompt-tokens in chunks, 16 decode steps: activations and workspaces
the allocator keeps); then each canary self-test (RSS after, and its peak while it ran, sampled every 10 ms).

`--sandbox-builds-model` gives each sandbox engine a model of its own (what main did before it shared the
worker's), `--no-release` skips the self-test's gc + malloc_trim: the before arms in bench/RESULTS.md.
Ends with one JSON line."""
import argparse
import json
import os
import threading
import time

from inference.memory import malloc_arena_max, process_memory
from inference.settings import engine_settings

MB = 2**20


class Steps:
    """Memory after each step, as deltas from the one before."""

    def __init__(self):
        self.rows: list[dict] = []
        self.last = process_memory()
        self.start = self.last

    def note(self, name: str, counted_bytes: int | None = None, **extra) -> dict:
        now = process_memory()
        row = {"step": name, "rss_mb": now["VmRSS"] / MB, "delta_mb": (now["VmRSS"] - self.last["VmRSS"]) / MB,
               "anon_mb": (now["RssAnon"] - self.last["RssAnon"]) / MB,
               "file_mb": (now["RssFile"] - self.last["RssFile"]) / MB,
               "counted_mb": None if counted_bytes is None else counted_bytes / MB, **extra}
        self.rows.append(row)
        self.last = now
        print(f"{name:46s} rss {row['rss_mb']:7.0f} MB  {row['delta_mb']:+7.0f}  (anon {row['anon_mb']:+6.0f}, "
              f"file {row['file_mb']:+6.0f})" + ("" if counted_bytes is None else f"  counted {counted_bytes / MB:.0f} MB"),
              flush=True)
        return row


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def packed_bytes(llama) -> int:
    """The model's own tensors that are not views of the loaded weights (fused and prepacked copies)."""
    from inference.precision import CodedWeight, Int4Weight  # here: bench.memory times torch's import step by step

    def parts(w) -> tuple:  # int4w's and w4a8's weights hold their codes, scales and a dense copy for big batches
        if isinstance(w, Int4Weight):
            return w.codes, w.scales_zeros, w.dense
        if isinstance(w, CodedWeight):
            return tuple(t for t in (w.codes, w.scale, w.mins, w.dense) if t is not None)
        return (w,)

    head = llama.lm_head
    tied = hasattr(head, "is_mkldnn") and not head.is_mkldnn and head.data_ptr() == llama.embed.data_ptr()
    own = [] if tied else [head]
    for layer in llama.layers:
        own += [layer["qkv"], layer["o"], layer["gate_up"], layer["down"]]
    own = [t for w in own for t in parts(w)]
    return tensor_bytes(own) + tensor_bytes([llama.cos, llama.sin])


class PeakSampler:
    """The highest VmRSS seen while the block runs (every `interval_s`)."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()

    def __enter__(self):
        self.peak = process_memory()["VmRSS"]
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, process_memory()["VmRSS"])

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, process_memory()["VmRSS"])


def run_in_thread(fn, name: str):
    """As incidents.canary.suite runs a check: in a thread of its own (its own malloc arena)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", fn()), name=name)
    thread.start()
    thread.join()
    return out.get("result")


def sandbox_builds_model() -> None:
    """The before arm: every engine packs a model of its own (no sharing with the worker's)."""
    from inference import engine
    from inference.model import Llama

    engine.shared_model = lambda m, dtype, device, backend, precision="fp32": Llama(
        m.config, m.weights, dtype=dtype, device=device, attention_backend=backend, precision=precision)


def measure(num_pages: int, canary_runs: int, prompt_tokens: int, role: str = "prefill", share: bool = True,
            release: bool = True) -> dict:
    steps = Steps()
    steps.note("python interpreter")
    import torch

    steps.note("import torch")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")
    import django

    django.setup()
    import kvserve.worker_boot  # noqa: F401  (the worker's Celery app, signals and patches)
    from inference import engine as engine_mod
    from inference.engine import Engine, EngineConfig
    from inference.loader import load_model, load_tokenizer
    from inference.threads import torch_threads_apply
    from incidents.canary import selftest

    threads = torch_threads_apply(role)
    steps.note("Django + Celery app + worker modules")
    load_tokenizer()
    steps.note("tokenizer (tokenizers BPE)")
    model = load_model()
    weights = tensor_bytes(model.weights.values())
    steps.note("weights: fp32 safetensors cache, mmapped", weights)
    config = EngineConfig.from_env(num_pages=num_pages)
    dtype, device = getattr(torch, config.dtype), torch.device(config.device)
    from inference.attention import select_backend

    llama = engine_mod.shared_model(model, dtype, device, config.attention or select_backend(device, dtype))
    touched_by_packing = "the packing read every weight: their file pages are now resident"
    steps.note(f"model: fused + prepacked ({llama.gemm})", packed_bytes(llama), note=touched_by_packing)
    engine = Engine(model, config)
    steps.note(f"KV page pool ({num_pages} pages) + engine", engine.pool.data.numel() * engine.pool.data.element_size())
    from inference.sequence import SamplingParams, SeqStatus

    ids = (engine.tokenizer.encode_chat([{"role": "user", "content": "a quarterly report, revised. " * 400}])
           * (prompt_tokens // 100 + 1))[:prompt_tokens]
    seq = engine.add_request("warm-up", ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    while not seq.is_done:
        engine.step()
    if seq.status is not SeqStatus.FINISHED:
        raise RuntimeError(f"warm-up request ended {seq.status.value}: {seq.error}")
    engine.release(seq)
    steps.note(f"warm-up request ({prompt_tokens}-token prefill, 16 decode steps)")

    if not share:
        sandbox_builds_model()
    if not release:
        selftest.release_freed_memory = lambda: None
    before = process_memory()["VmRSS"]
    runs = []
    for i in range(canary_runs):
        started = time.perf_counter()
        with PeakSampler() as sampler:
            result = run_in_thread(lambda: selftest.check_selftest(model), f"canary-selftest-{i}")
        row = steps.note(f"canary self-test run {i + 1} ({'passed' if result.passed else 'FAILED'})",
                         peak_mb=sampler.peak / MB)
        runs.append({"rss_mb": row["rss_mb"], "peak_mb": sampler.peak / MB, "passed": result.passed,
                     "seconds": time.perf_counter() - started})
        print(f"{'':46s} peak while it ran {sampler.peak / MB:7.0f} MB", flush=True)
    del engine, llama
    after = process_memory()
    return {"bench": "memory", "role": role, "num_pages": num_pages, "torch_threads": threads,
            "malloc_arena_max": malloc_arena_max(), "sandbox_shares_model": share, "sandbox_releases": release,
            "weights_mb": weights / MB, "steps": steps.rows, "canary_runs": runs,
            "worker_rss_mb": before / MB, "rss_mb_after_canaries": runs[-1]["rss_mb"] if runs else before / MB,
            "canary_growth": (runs[-1]["rss_mb"] * MB - before) / before if runs else 0.0,
            "canary_peak_growth": (max(r["peak_mb"] for r in runs) * MB - before) / before if runs else 0.0,
            "peak_rss_mb": after["VmHWM"] / MB}


SANDBOX_CHECKS = ["selftest", "reproduction"]  # what the canary runs in the maintenance worker itself (e2e)


def canary_task(stack, last_run: int, timeout_s: float = 300) -> tuple[int, dict]:
    """Sends the scheduled task for the sandbox checks, as beat does; (run id, {check: passed}) once stored."""
    stack.manage("shell", "-c", "from kvserve.celery import app; "
                                f"app.send_task('kvserve.canary', kwargs={{'only': {SANDBOX_CHECKS!r}}})")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = stack.sql("select id, checks from incidents_canaryrun where id > ? and finished_at is not null "
                         "order by id", last_run)
        if done:
            run_id, checks = done[0]
            checks = json.loads(checks) if isinstance(checks, str) else checks
            return run_id, {c["name"]: c["passed"] for c in checks}
        time.sleep(0.5)
    raise TimeoutError(f"the canary task did not finish in {timeout_s}s: {stack.tail('prefill')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-pages", type=int, default=engine_settings()["num_pages"])
    ap.add_argument("--canary-runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--role", default="prefill", choices=("prefill", "decode"))
    ap.add_argument("--sandbox-builds-model", action="store_true", help="before arm: no sharing of the model")
    ap.add_argument("--no-release", action="store_true", help="before arm: no gc + malloc_trim after the self-test")
    args = ap.parse_args()
    result = measure(args.num_pages, args.canary_runs, args.prompt_tokens, args.role,
                     share=not args.sandbox_builds_model, release=not args.no_release)
    print(f"canary self-test: worker {result['worker_rss_mb']:.0f} MB before, {result['rss_mb_after_canaries']:.0f} MB "
          f"after {args.canary_runs} runs ({result['canary_growth']:+.1%}), peak while running "
          f"{result['canary_peak_growth']:+.1%}", flush=True)
    from bench.common import emit_json

    emit_json(result)


if __name__ == "__main__":
    main()
