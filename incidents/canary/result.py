"""What a canary check returns: its outcome, what it saw, and the incidents its failure calls for.

Every check, and every probe of a worker within one, ends in one of three outcomes:
  passed      refused what it must refuse, answered what it must answer
  wrong       the worker (or the stack) answered, wrongly: a critical incident; on a worker, a quarantine
  not_judged  no verdict: busy, unreachable, timed out, vacuous. A warning, never a quarantine
An incident's severity is its outcome (critical: wrong, warning: not judged), so a check's outcome is read
from the incidents it calls for (`outcome_of`), and a run's from its checks' (`outcome_worst`)."""
from dataclasses import dataclass, field

PASSED, WRONG, NOT_JUDGED = "passed", "wrong", "not_judged"
OUTCOMES = (PASSED, NOT_JUDGED, WRONG)  # in order of gravity
SEVERITY = {WRONG: "critical", NOT_JUDGED: "warning"}  # the incident each failed outcome calls for
LABEL = {PASSED: "PASSED", WRONG: "WRONG", NOT_JUDGED: "NOT JUDGED"}


def outcome_worst(outcomes) -> str:
    """The gravest of `outcomes` (passed when there are none)."""
    return max(outcomes, key=OUTCOMES.index, default=PASSED)


def outcome_of_severities(severities) -> str:
    """The outcome that incidents of these severities stand for: any critical is wrong, else not judged."""
    severities = set(severities)
    return WRONG if "critical" in severities else NOT_JUDGED


def outcome_stored(check: dict) -> str:
    """The outcome of a stored check (CanaryRun.checks); runs stored before outcomes existed: passed or wrong."""
    outcome = check.get("outcome")
    return outcome if outcome in OUTCOMES else PASSED if check.get("passed") else WRONG


def outcome_of_run(checks: list[dict]) -> str:
    """A run's outcome from its stored checks; a run that judged nothing is not judged."""
    return outcome_worst(outcome_stored(c) for c in checks) if checks else NOT_JUDGED


@dataclass
class IncidentSpec:
    """Arguments for incidents.services.incident_record. Critical with a worker set quarantines that worker."""

    kind: str
    severity: str = "critical"
    worker: str = ""
    pool: str = ""
    pages: list[int] = field(default_factory=list)
    reader_request: str = ""
    previous_owner_request: str = ""
    epochs: list | dict | None = None
    details: dict = field(default_factory=dict)


@dataclass
class CheckResult:
    name: str
    passed: bool
    duration_s: float = 0.0
    details: dict = field(default_factory=dict)
    incidents: list[IncidentSpec] = field(default_factory=list)  # recorded by the suite when the check fails

    @property
    def outcome(self) -> str:
        return PASSED if self.passed else outcome_of_severities(i.severity for i in self.incidents)

    def outcome_for(self, worker: str) -> str:
        """This check's outcome on one worker: what the incidents naming it stand for."""
        mine = [i.severity for i in self.incidents if i.worker == worker] if not self.passed else []
        return outcome_of_severities(mine) if mine else PASSED

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "outcome": self.outcome,
                "duration_s": round(self.duration_s, 3), "details": self.details}

    @classmethod
    def vacuous(cls, name: str, reason: str, **details) -> "CheckResult":
        """A check that could not prove anything fails, not judged: a canary that cannot see is not a passing
        canary. Its incident is a warning (nothing leaked that we know of) on no worker."""
        return cls(name, False, details={"reason": f"vacuous: {reason}", **details},
                   incidents=[IncidentSpec(kind="canary_leak", severity=SEVERITY[NOT_JUDGED],
                                           details={"reason": f"vacuous: {reason}"})])
