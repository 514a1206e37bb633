"""What a canary check returns: whether it passed, what it saw, and the incidents its failure calls for."""
from dataclasses import dataclass, field


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

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "duration_s": round(self.duration_s, 3),
                "details": self.details}

    @classmethod
    def vacuous(cls, name: str, reason: str, **details) -> "CheckResult":
        """A check that could not prove anything fails: a canary that cannot see is not a passing canary.
        Its incident is a warning (nothing leaked that we know of) on no worker."""
        return cls(name, False, details={"reason": f"vacuous: {reason}", **details},
                   incidents=[IncidentSpec(kind="canary_leak", severity="warning",
                                           details={"reason": f"vacuous: {reason}"})])
