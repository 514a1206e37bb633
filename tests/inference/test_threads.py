"""KVSERVE_TORCH_THREADS and the per-role defaults (workers sharing a host split its cores)."""
import os

import pytest
import torch

from inference.threads import torch_threads_apply, torch_threads_for


def test_workers_take_half_the_cores_and_everything_else_all_of_them():
    cores = os.cpu_count() or 1
    assert torch_threads_for("prefill", env={}) == torch_threads_for("decode", env={}) == max(1, cores // 2)
    assert torch_threads_for(None, env={}) == cores


def test_the_variable_overrides_every_role_and_bad_values_name_it():
    assert torch_threads_for("decode", env={"KVSERVE_TORCH_THREADS": "3"}) == 3
    assert torch_threads_for(None, env={"KVSERVE_TORCH_THREADS": " 1 "}) == 1
    for bad in ("0", "-2", "two"):
        with pytest.raises(ValueError, match="KVSERVE_TORCH_THREADS"):
            torch_threads_for("prefill", env={"KVSERVE_TORCH_THREADS": bad})


def test_apply_sets_torchs_thread_count(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("KVSERVE_TORCH_THREADS", "1")
    try:
        assert torch_threads_apply("decode") == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
