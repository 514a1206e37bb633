"""`make run`'s supervisor with real processes: a child killed with SIGKILL (or exiting non-zero) comes back
after its backoff, every exit and restart is logged, and only SIGTERM/SIGINT stops the stack."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a stand-in for a worker: records its pid, then waits to be killed
CHILD = "import os, sys, time; open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); time.sleep(3600)"
# a stand-in for a worker whose loop died: it exits 70 at once, every time
CRASHER = "import os, sys; open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); sys.exit(70)"


def pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def wait_for(predicate, timeout_s=30.0, what=""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


@pytest.fixture
def supervised(tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from scripts.supervisor import Supervisor
        py, d = sys.executable, {str(tmp_path)!r}
        sup = Supervisor({{"decode": [py, "-c", {CHILD!r}, d + "/decode.pids"],
                          "beat": [py, "-c", {CRASHER!r}, d + "/beat.pids"]}},
                         cwd=d, log_dir=d + "/logs", min_backoff_s=0.2, max_backoff_s=0.8, stable_s=60)
        sys.exit(sup.run())
    """))
    proc = subprocess.Popen([sys.executable, str(launcher)], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    yield proc, tmp_path
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids(tmp_path / "decode.pids"):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_killed_child_comes_back_and_only_sigterm_stops_the_stack(supervised):
    proc, d = supervised
    wait_for(lambda: len(pids(d / "decode.pids")) == 1, what="the decode child to start")
    (first,) = pids(d / "decode.pids")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: len(pids(d / "decode.pids")) == 2, what="the killed child to be restarted")
    second = pids(d / "decode.pids")[1]
    assert second != first and alive(second) and not alive(first)
    # a child that keeps failing is restarted with a growing backoff, never given up on
    wait_for(lambda: len(pids(d / "beat.pids")) >= 6, what="the crashing child's restarts")
    assert proc.poll() is None  # one child exiting never stops the stack
    log = (d / "logs" / "supervisor.log").read_text()
    assert f"decode (pid {first}) exited with -9" in log and "restarted decode" in log
    assert "beat" in log and "exited with 70" in log
    backoffs = [float(line.rsplit("restarting in ", 1)[1].split("s ")[0]) for line in log.splitlines()
                if line.split("supervisor: ", 1)[1].startswith("beat") and "restarting in" in line]
    assert backoffs[:4] == [0.2, 0.4, 0.8, 0.8]  # doubling per quick exit, capped
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not alive(second)
    assert "got SIGTERM: stopping every process" in (d / "logs" / "supervisor.log").read_text()
