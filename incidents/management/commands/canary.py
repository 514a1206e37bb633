"""`manage.py canary [--json] [--only a,b] [--skip c]`: run the canary suite now (the scheduled task runs the
same code), store a CanaryRun. Exit status: 0 every check passed, 1 a check found something wrong (critical),
2 a check could not judge (not judged: warnings only, nothing quarantined). With --json the output ends with one
JSON line: {"passed": ..., "outcome": ..., "run": id, "checks": [{"name", "passed", "outcome", "duration_s",
"details"}, ...]}."""
import json
import sys

from django.core.management.base import BaseCommand, CommandError

from incidents.canary.result import LABEL, NOT_JUDGED, PASSED, outcome_of_run, outcome_stored
from incidents.canary.suite import CHECKS, canary_run, select_checks


def _names(value: str | None) -> list[str] | None:
    return [n.strip() for n in value.split(",") if n.strip()] if value else None


class Command(BaseCommand):
    help = "Run the canary checks now; exit status 0 all passed, 1 something wrong, 2 something not judged."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="end the output with one JSON line")
        parser.add_argument("--only", help=f"comma-separated checks to run (of {', '.join(CHECKS)})")
        parser.add_argument("--skip", help="comma-separated checks to leave out")

    def handle(self, *args, **options):
        try:
            select_checks(_names(options["only"]), _names(options["skip"]))
        except ValueError as exc:
            raise CommandError(str(exc))
        run = canary_run(_names(options["only"]), _names(options["skip"]))
        outcome = outcome_of_run(run.checks)
        self.stdout.write(f"canary run #{run.pk}: {LABEL[outcome]}")
        for check in run.checks:
            line = f"  [{'ok' if check['passed'] else LABEL[outcome_stored(check)]}] {check['name']} ({check['duration_s']:.1f}s)"
            if not check["passed"]:
                d = check["details"]
                line += f": {d.get('reason') or '; '.join(map(str, d.get('problems', [])))[:500]}"
                if d.get("incidents"):
                    line += f" (incidents {d['incidents']})"
            self.stdout.write(line)
        if options["json"]:
            self.stdout.write(json.dumps({"passed": run.passed, "outcome": outcome, "run": run.pk, "checks": run.checks},
                                         separators=(",", ":"), default=str))
        self.stdout.flush()
        if outcome != PASSED:
            sys.exit(2 if outcome == NOT_JUDGED else 1)

