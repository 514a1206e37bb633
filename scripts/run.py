"""`make run`: migrate, bootstrap the admin user and a demo key, start every kvserve process under a
supervisor that restarts any that exits (scripts/supervisor.py), print where to go; only Ctrl-C or
SIGTERM stops them all. Honours REDIS_URL, DATABASE_URL, KVSERVE_PORT and KVSERVE_LOG_DIR (default
var/logs/<port>/: stacks on different ports keep their logs apart)."""
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from inference.memory import process_env  # noqa: E402
from inference.settings import log_dir_setting, port_setting  # noqa: E402
from scripts.supervisor import Supervisor  # noqa: E402

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


def log_dir(port: int) -> Path:
    """The stack's own log directory: KVSERVE_LOG_DIR, else var/logs/<port>/."""
    return Path(log_dir_setting(str(ROOT / "var" / "logs" / str(port)))).expanduser()


def wait_ready(url: str, supervisor: Supervisor, timeout_s: float = 180) -> bool:
    """Supervises while waiting for the stack to answer: a process that fails at start is restarted."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        supervisor.poll()
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:
            pass
        time.sleep(0.5)
    return False


def main() -> int:
    port = port_setting()
    print("migrating ...", flush=True)
    manage("migrate", "--noinput")
    manage("setup_schedules")
    creds = json.loads(manage("bootstrap_demo").strip().splitlines()[-1])
    logs = log_dir(port)
    # `make run` serves what this CPU runs fastest within its accuracy contract, one choice for both workers
    # (inference.worker.precision_agree); KVSERVE_PRECISION=fp32 serves Hugging Face's exact text
    env = {"KVSERVE_PRECISION": "auto", **os.environ}
    supervisor = Supervisor(processes(port), cwd=ROOT, log_dir=logs, env=process_env(env))
    supervisor.start_all()
    base = f"http://127.0.0.1:{port}"
    if not wait_ready(f"{base}/healthz", supervisor):
        print(f"kvserve is not answering yet at {base}/healthz; still supervising (see {logs}/*.log)",
              file=sys.stderr, flush=True)
    print(f"""
kvserve is up.
  API         {base}/v1/chat/completions   (OpenAI-compatible)
  API docs    {base}/api/docs/
  dashboard   {base}/dashboard/            admin: {base}/admin/
  health      {base}/healthz
  metrics     {base}/metrics   (Authorization: Bearer {creds['metrics_token']})
  admin login {creds['admin_user']} / {creds['admin_password']}
  API key     {creds['api_key']}
  logs        {logs}/   (supervisor.log: every exit and restart)

curl {base}/v1/chat/completions -H "Authorization: Bearer {creds['api_key']}" \\
  -H "Content-Type: application/json" -d '{{"messages":[{{"role":"user","content":"What is the capital of France?"}}]}}'

A process that exits is restarted (with backoff); Ctrl-C stops everything.""", flush=True)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
