"""Keeps a set of processes running (`make run`): a child that exits is restarted after a backoff that doubles
with each quick exit (from `min_backoff_s` up to `max_backoff_s`, back to the minimum once a child stayed
up `stable_s`), and every exit and restart is logged. Only SIGINT or SIGTERM stops it, and then every child.

In production use the init system instead: one systemd unit per role with Restart=always (README)."""
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None  # when an exited child is due to start again
    exits: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(self, commands: dict[str, list[str]], *, cwd: Path, log_dir: Path, env: dict | None = None,
                 min_backoff_s: float = 1.0, max_backoff_s: float = 60.0, stable_s: float = 60.0):
        self.children = {name: Child(name, cmd) for name, cmd in commands.items()}
        self.cwd, self.log_dir, self.env = Path(cwd), Path(log_dir), env
        self.min_backoff_s, self.max_backoff_s, self.stable_s = min_backoff_s, max_backoff_s, stable_s
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._stopping = False

    def log(self, message: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} supervisor: {message}"
        print(line, file=sys.stderr, flush=True)
        with open(self.log_dir / "supervisor.log", "a") as f:
            f.write(line + "\n")

    def start(self, child: Child) -> None:
        out = open(self.log_dir / f"{child.name}.log", "ab")
        child.proc = subprocess.Popen(child.cmd, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        out.close()
        child.started_at, child.restart_at = time.monotonic(), None

    def start_all(self) -> None:
        for child in self.children.values():
            self.start(child)
            self.log(f"started {child.name} (pid {child.proc.pid})")

    def poll(self) -> None:
        """Notices exits and restarts children whose backoff has passed."""
        now = time.monotonic()
        for child in self.children.values():
            if child.restart_at is None and child.proc is not None and child.proc.poll() is not None:
                code = child.proc.returncode
                child.exits.append(code)
                up_s = now - child.started_at
                quick = up_s < self.stable_s
                child.backoff_s = min(self.max_backoff_s, max(self.min_backoff_s, child.backoff_s * 2)) if quick \
                    else self.min_backoff_s
                child.restart_at = now + child.backoff_s
                self.log(f"{child.name} (pid {child.proc.pid}) exited with {code} after {up_s:.0f}s; restarting in "
                         f"{child.backoff_s:.1f}s (see {self.log_dir / child.name}.log)")
            if child.restart_at is not None and now >= child.restart_at and not self._stopping:
                self.start(child)
                child.restarts += 1
                self.log(f"restarted {child.name} (pid {child.proc.pid}, restart #{child.restarts})")

    def stop_all(self, timeout_s: float = 15) -> None:
        self._stopping = True
        running = [c.proc for c in self.children.values() if c.proc is not None and c.proc.poll() is None]
        for proc in running:
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def run(self, on_tick=None) -> int:
        """Supervises until SIGINT or SIGTERM, then stops every child; returns 0. `on_tick()` runs each poll."""
        stop = []
        previous = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if not any(c.proc for c in self.children.values()):
                self.start_all()
            while not stop:
                self.poll()
                if on_tick:
                    on_tick()
                time.sleep(0.5)
            self.log(f"got {signal.Signals(stop[0]).name}: stopping every process")
            self.stop_all()
            return 0
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
