"""The import contracts in .importlinter hold: layers incidents -> kvserve -> inference, no import cycle within a
package at any depth, inference free of Django and Celery, the Celery app module configuration only, tasks sent
by name. Checked by import-linter in a process of its own, exactly as `lint-imports` runs from the repository
root."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is not installed (requirements.txt pins it)")

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))")


def test_the_import_contracts_hold():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    lint = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout[-6000:] + lint.stderr[-3000:]
    assert " 0 broken." in lint.stdout, lint.stdout[-3000:]
