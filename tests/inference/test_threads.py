"""KVSERVE_TORCH_THREADS, the per-role defaults and the core budget workers sharing a host lend each other."""
import os
import subprocess
import sys

import pytest
import torch

from inference import native
from inference.threads import CoreBudget, core_budget_for, threads_set, torch_threads_apply, torch_threads_for


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


def _budget(tmp_path, pid, cores=2):
    return CoreBudget(tmp_path / "cores", cores, pid=pid)


def test_a_worker_alone_with_work_takes_every_core_and_shares_them_when_another_has_work(tmp_path):
    prefill, decode = _budget(tmp_path, os.getpid()), _budget(tmp_path, os.getppid())
    assert prefill.threads_for_step() == 2  # decode has nothing to step
    assert decode.threads_for_step() == 1  # both have work: half each
    assert prefill.threads_for_step() == 1
    decode.idle()
    assert prefill.threads_for_step() == 2  # its cores come back as soon as it idles
    prefill.idle()
    assert decode.threads_for_step() == 2


def test_a_dead_workers_slot_counts_for_nothing_and_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = _budget(tmp_path, dead.pid)
    gone.threads_for_step()  # it died with work marked
    live = _budget(tmp_path, os.getppid())
    assert live._mine == gone._mine  # the dead process's slot, taken over
    assert live.threads_for_step() == 2  # the dead one's work is not counted
    other = _budget(tmp_path, os.getpid())
    assert other.threads_for_step() == 1 and live.threads_for_step() == 1
    live.idle()
    assert other.threads_for_step() == 2


def test_the_budget_is_off_where_threads_are_fixed(tmp_path):
    assert core_budget_for("decode", "t", env={"KVSERVE_THREAD_BUDGET": "fixed"}) is None
    assert core_budget_for("decode", "t", env={"KVSERVE_TORCH_THREADS": "1"}) is None
    assert core_budget_for(None, "t", env={}) is None
    budget = core_budget_for("decode", f"kvstest-{os.getpid()}", env={"KVSERVE_THREAD_BUDGET": "shared"})
    try:
        assert isinstance(budget, CoreBudget) and budget.cores == (os.cpu_count() or 1) and budget.torch_too
    finally:
        budget.close()
    with pytest.raises(ValueError, match="KVSERVE_THREAD_BUDGET"):
        core_budget_for("decode", "t", env={"KVSERVE_THREAD_BUDGET": "elastic"})


def test_apply_sets_the_threads_of_the_calling_thread(tmp_path):
    before = torch.get_num_threads()
    try:
        budget = _budget(tmp_path, os.getpid(), cores=2)
        assert budget.apply() == 2 and torch.get_num_threads() == 2
        other = _budget(tmp_path, os.getppid(), cores=2)
        other.threads_for_step()
        assert budget.apply() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not native.fused_available(), reason="the native library is built by make install")
def test_a_lent_budget_moves_the_native_kernels_threads_and_leaves_torchs(tmp_path):
    before, native_before = torch.get_num_threads(), native.threads()
    try:
        torch.set_num_threads(1)
        budget = CoreBudget(tmp_path / "cores", 2, pid=os.getpid(), torch_too=False)
        assert budget.apply() == 2 and native.threads() == 2 and torch.get_num_threads() == 1
        other = CoreBudget(tmp_path / "cores", 2, pid=os.getppid(), torch_too=False)
        other.threads_for_step()
        assert budget.apply() == 1 and native.threads() == 1 and torch.get_num_threads() == 1
        other.idle()
        assert budget.apply() == 2 and native.threads() == 2
        lent = core_budget_for("decode", f"kvstest-lend-{os.getpid()}", env={})  # lend is the default
        assert isinstance(lent, CoreBudget) and not lent.torch_too and lent.path.exists()
        lent.close()
        assert not lent.path.exists()  # the last live worker of the host removes the file
        assert lent.threads_for_step() == 1  # closed: it lends nothing and marks nothing
    finally:
        torch.set_num_threads(before)
        native.set_threads(native_before)


@pytest.mark.skipif(not native.fused_available(), reason="the native library is built by make install")
def test_threads_set_sets_torchs_and_the_native_kernels(monkeypatch):
    before, native_before = torch.get_num_threads(), native.threads()
    try:
        assert threads_set(1) == 1 and torch.get_num_threads() == 1 and native.threads() == 1
        monkeypatch.setenv("KVSERVE_TORCH_THREADS", "2")
        assert torch_threads_apply("decode") == 2 and native.threads() == 2
    finally:
        torch.set_num_threads(before)
        native.set_threads(native_before)
