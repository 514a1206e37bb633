"""Detector self-test: the incident replayed in an isolated sandbox (inference.sandbox.IncidentReplay: two
fresh in-process engines on their own LocalAllocator pools, never a live worker's pages), once with every
guard off and once per guard switched back on.

Passing means both:
  (a) the leak reproduces with every guard off: the overlong request completes with no violation while
      its first decode step attends to pages never written for it whose bytes are exactly the previous
      request's K/V (page checksums), and the canary's own read-record audit flags that read;
  (b) each guard alone prevents or detects it: admission refuses before any page is reserved, the handoff
      check refuses the REJECTED handoff before decode reserves anything, the read guard raises
      OwnershipViolation (unwritten_read) before attention; and its owner/epoch half, alone, catches the
      variant in which decode reuses the previous request's page-table entries (stale_epoch).
If (a) fails the detectors are unproven ("detectors broken"); if a guard in (b) does not fire, it is broken.

In a worker the sandbox shares the worker's built model (inference.engine.shared_model) and, once done,
hands what it freed back to the kernel (inference.memory.release_freed_memory): a run leaves the serving
worker's RSS where it found it (tests/e2e/test_memory.py).
"""
import time
from functools import lru_cache

from inference.faults import Faults
from inference.loader import load_model
from inference.memory import release_freed_memory
from inference.sandbox import ALL_FAULTS, IncidentReplay
from incidents.canary.prompts import new_sentinel
from incidents.canary.result import CheckResult, IncidentSpec
from kvserve.chat.runtime import runtime_get

# scenario -> (faults injected, variant, what must happen)
SCENARIOS = {
    "admission_on": (ALL_FAULTS - {"no_admission"}, "reserve"),
    "handoff_check_on": (ALL_FAULTS - {"no_handoff_check"}, "reserve"),
    "read_guard_on": (ALL_FAULTS - {"no_ownership_guard", "no_watermark_guard"}, "reserve"),
    "watermark_guard_on": (ALL_FAULTS - {"no_watermark_guard"}, "reserve"),
    "ownership_guard_on": (ALL_FAULTS - {"no_ownership_guard"}, "stale_table"),
    "all_guards_off": (ALL_FAULTS, "reserve"),  # last: the only scenario whose decode runs attention
}
# the incident kind recorded when a scenario does not behave
INCIDENT_KIND = {"admission_on": "config_unsafe", "handoff_check_on": "handoff_mismatch",
                 "read_guard_on": "unwritten_read", "watermark_guard_on": "unwritten_read",
                 "ownership_guard_on": "stale_epoch", "all_guards_off": "canary_leak"}


@lru_cache(maxsize=1)
def _loaded_model():
    return load_model()


def sandbox_model():
    """The model already loaded by this process's worker runtime (scheduled runs), else loaded once."""
    try:
        return runtime_get().engine.loaded
    except Exception:
        return _loaded_model()


def judge(name: str, o) -> str | None:
    """Why scenario `name`'s outcome is wrong, or None."""
    if name == "all_guards_off":
        if not o.leaked:
            return (f"detectors broken: with every guard off the replay did not read the previous request's pages "
                    f"(stopped_by={o.stopped_by}, status={o.status}, stale_pages={o.stale_pages})")
        if not any(p["kind"] == "unwritten_read" for p in o.audit):
            return "detectors broken: the read-record audit did not flag the leaking read"
        return None
    if name == "admission_on":
        if o.stopped_by != "admission" or o.refusal_kind != "context_length_exceeded":
            return f"admission did not refuse the overlong prompt (stopped_by={o.stopped_by})"
        if o.handoff is not None or o.pages_taken:
            return "the overlong prompt reached prefill before admission refused it"
        return None
    if name == "handoff_check_on":
        if o.stopped_by != "handoff" or o.refusal_kind != "rejected":
            return f"the handoff check did not refuse the REJECTED handoff (stopped_by={o.stopped_by}, {o.refusal_kind})"
        if o.pages_taken.get("decode"):
            return "decode reserved pages before refusing the handoff"
        return None
    want = "stale_epoch" if name == "ownership_guard_on" else "unwritten_read"
    if o.stopped_by != "guard" or o.refusal_kind != want or o.output_tokens:
        return f"the read guard did not raise {want} (stopped_by={o.stopped_by}, kind={o.refusal_kind})"
    return None


def check_selftest(model=None) -> CheckResult:
    started = time.perf_counter()
    try:
        with IncidentReplay(model or sandbox_model(), sentinel=new_sentinel()) as replay:
            return _selftest(replay, started)
    finally:
        release_freed_memory()


def _selftest(replay: IncidentReplay, started: float) -> CheckResult:
    previous = replay.setup()
    outcomes, failures = {}, {}
    for name, (faults, variant) in SCENARIOS.items():
        before = replay.free_pages()
        outcome = replay.run(Faults(faults), name, variant)
        after = replay.free_pages()
        outcomes[name] = outcome
        why = judge(name, outcome)
        if after != before:
            why = why or f"sandbox pages not returned: {before} -> {after}"
        if why:
            failures[name] = why
    incidents = [IncidentSpec(kind=INCIDENT_KIND[name], pool=replay.pools()["decode_pool"], details={
        "detected_by": "canary self-test (sandbox replay)", "scenario": name, "reason": why,
        "outcome": _brief(outcomes[name])}) for name, why in failures.items()]
    leak = outcomes["all_guards_off"]
    details = {
        "sandbox": replay.pools(),
        "previous": {k: previous[k] for k in ("request", "prompt_tokens", "output_tokens", "sentinel_echoed", "written")},
        "observable": {
            "leak_reproduced": leak.leaked, "stale_pages": leak.stale_pages,
            "read_len": (leak.read_record or {}).get("read_len"),
            "written_for_reader": sum((leak.read_record or {}).get("written", [])),
            "audit": leak.audit, "completed_silently": leak.status == "finished" and leak.stopped_by is None,
            "previous_sentinel_in_output": leak.previous_sentinel_in_output,
        },
        "scenarios": {name: {**_brief(o), "ok": name not in failures, "problem": failures.get(name)}
                      for name, o in outcomes.items()},
    }
    if failures:
        details["reason"] = "; ".join(f"{n}: {w}" for n, w in failures.items())
    return CheckResult("selftest", not failures, time.perf_counter() - started, details, incidents)


def _brief(o) -> dict:
    return {"faults": o.faults, "variant": o.variant, "stopped_by": o.stopped_by, "kind": o.refusal_kind,
            "handoff": o.handoff, "pages_taken": o.pages_taken, "stale_pages": o.stale_pages,
            "status": o.status, "output_tokens": o.output_tokens}
