"""`make run`: migrate, bootstrap the admin user and a demo key, start every kvserve process, print
where to go; Ctrl-C or SIGTERM stops them all. Honours REDIS_URL, DATABASE_URL and KVSERVE_PORT."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def manage(*args) -> str:
    return subprocess.run([PY, "manage.py", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def processes(port: int) -> dict[str, list[str]]:
    celery = [PY, "-m", "celery", "-A", "kvserve"]
    return {
        "prefill": celery + ["worker", "-Q", "prefill,maintenance", "-n", "prefill@%h", "--loglevel", "INFO"],
        "decode": celery + ["worker", "-Q", "decode", "-n", "decode@%h", "--loglevel", "INFO"],
        "beat": celery + ["beat", "--loglevel", "INFO"],
        "web": [PY, "-m", "uvicorn", "kvserve.asgi:application", "--host", "127.0.0.1", "--port", str(port),
                "--timeout-graceful-shutdown", "5"],
    }


def wait_ready(url: str, procs, timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs.values()):
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:
            pass
        time.sleep(0.5)
    return False


def main() -> int:
    port = int(os.environ.get("KVSERVE_PORT", 8000))
    print("migrating ...", flush=True)
    manage("migrate", "--noinput")
    manage("setup_schedules")
    creds = json.loads(manage("bootstrap_demo").strip().splitlines()[-1])
    logs = ROOT / "var" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, cmd in processes(port).items():
        out = open(logs / f"{name}.log", "ab")
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(*_):
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    base = f"http://127.0.0.1:{port}"
    if not wait_ready(f"{base}/healthz", procs):
        dead = [n for n, p in procs.items() if p.poll() is not None]
        print(f"kvserve did not become ready (exited: {dead}); see {logs}/*.log", file=sys.stderr)
        stop()
    print(f"""
kvserve is up.
  API         {base}/v1/chat/completions   (OpenAI-compatible)
  API docs    {base}/api/docs/
  dashboard   {base}/dashboard/            admin: {base}/admin/
  health      {base}/healthz
  admin login {creds['admin_user']} / {creds['admin_password']}
  API key     {creds['api_key']}
  logs        {logs}/

curl {base}/v1/chat/completions -H "Authorization: Bearer {creds['api_key']}" \\
  -H "Content-Type: application/json" -d '{{"messages":[{{"role":"user","content":"What is the capital of France?"}}]}}'

Ctrl-C stops everything.""", flush=True)
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                print(f"{name} exited with {p.returncode}; stopping (see {logs}/{name}.log)", file=sys.stderr)
                stop()
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
