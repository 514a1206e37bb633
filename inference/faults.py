"""Fault injection: the only way to switch a guard or scrubbing off (KVSERVE_FAULTS).

Used by tests and by the canary self-test's sandbox pool. A worker with any fault active
logs it loudly at start and reports it in its registration.
"""
import logging

from inference.settings import env_parsed

log = logging.getLogger(__name__)

# name -> what turning it on disables
KNOWN_FAULTS = {
    "no_ownership_guard": "attention reads are not checked against page owner and epoch",
    "no_watermark_guard": "attention reads are not checked against the written watermark",
    "no_scrub": "freed pages keep their contents",
    "no_admission": "overlong prompts are not refused at admission",
    "no_handoff_check": "decode accepts any handoff verdict and counts",
    "placeholder_on_reject": "prefill swaps a rejected prompt for a 1-token placeholder (the incident)",
    "foreign_page_once": "the first request a decode worker admits gets a page it does not own in its block table "
                         "(another running request's, else a bystander's): the read guard must stop it",
    "no_prefix_scope": "prefill reads and fills one prefix-cache scope for every tenant (the salt ignores the tenant)",
}


class Faults(frozenset):
    """The set of active faults; `"name" in faults` tells whether a guard is off."""

    @classmethod
    def parse(cls, spec: str | None) -> "Faults":
        names = [n.strip() for n in (spec or "").split(",") if n.strip()]
        unknown = sorted(set(names) - KNOWN_FAULTS.keys())
        if unknown:
            raise ValueError(
                f"KVSERVE_FAULTS names unknown faults {unknown}; known: {sorted(KNOWN_FAULTS)}"
            )
        return cls(names)

    @classmethod
    def from_env(cls) -> "Faults":
        return env_parsed("KVSERVE_FAULTS", "", cls.parse, "comma-separated fault names, or nothing")

    def announce(self, who: str) -> None:
        for name in sorted(self):
            log.warning("FAULT INJECTION ACTIVE in %s: %s (%s)", who, name, KNOWN_FAULTS[name])


NO_FAULTS = Faults()
