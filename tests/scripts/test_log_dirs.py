"""Each stack logs into a directory of its own: `make run` one keyed by its port (or KVSERVE_LOG_DIR), the
e2e/bench Stack one under its work directory, so a second stack's lines never land in the first one's files."""
from pathlib import Path

from scripts.run import log_dir
from tests.e2e.stack import Stack

ROOT = Path(__file__).resolve().parents[2]


def test_make_run_logs_per_port_unless_told_where(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSERVE_LOG_DIR", raising=False)
    assert log_dir(8000) == ROOT / "var" / "logs" / "8000"
    assert log_dir(8001) == ROOT / "var" / "logs" / "8001"
    monkeypatch.setenv("KVSERVE_LOG_DIR", str(tmp_path / "ours"))
    assert log_dir(8000) == tmp_path / "ours"


def test_every_stack_logs_under_its_own_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_LOG_DIR", str(tmp_path / "shared"))  # `make run`'s, in the environment: not a Stack's
    first, second = Stack(tmp_path / "a"), Stack(tmp_path / "b")
    assert (first.logs, second.logs) == (tmp_path / "a" / "logs", tmp_path / "b" / "logs")
    assert first.logs.is_dir() and second.logs.is_dir()
    named = Stack(tmp_path / "c", KVSERVE_LOG_DIR=str(tmp_path / "c-logs"))
    assert named.logs == tmp_path / "c-logs" and named.logs.is_dir()
    for stack in (first, second, named):
        stack.redis.close()
