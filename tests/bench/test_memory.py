"""`python -m bench.memory`: a worker's pieces loaded step by step in a real process, then the canary's
self-test run three times in it. Here the sandbox must build a model of its own (as in `manage.py canary`, or
a worker whose engine is not on the CPU): what it frees must still go back, RSS steady across runs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("import torch", "tokenizer", "weights", "model", "KV page pool", "warm-up request")


@pytest.mark.timeout(600)
def test_self_test_with_its_own_model_hands_back_what_it_frees():
    proc = subprocess.run([sys.executable, "-m", "bench.memory", "--num-pages", "64", "--canary-runs", "3",
                           "--prompt-tokens", "256", "--sandbox-builds-model"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    names = [s["step"] for s in result["steps"]]
    assert all(any(n.startswith(step) for n in names) for step in STEPS), names
    counted = {s["step"].split(":")[0].split(" (")[0]: s["counted_mb"] for s in result["steps"] if s["counted_mb"]}
    assert 400 < counted["weights"] < 700 and 400 < counted["model"] < 700, counted  # 135M params, fp32
    assert all(r["passed"] for r in result["canary_runs"]), result["canary_runs"]
    # each run packed ~0.5 GB of its own and freed it: RSS after the runs within 5 % of the worker's before
    assert result["canary_growth"] <= 0.05, proc.stdout[-3000:]
