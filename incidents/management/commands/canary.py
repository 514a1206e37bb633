"""`manage.py canary [--json] [--only a,b] [--skip c]`: run the canary suite now (the scheduled task runs the
same code), store a CanaryRun, exit 0 only when every check passed. With --json the output ends with one
JSON line: {"passed": ..., "run": id, "checks": [{"name", "passed", "duration_s", "details"}, ...]}."""
import json
import sys

from django.core.management.base import BaseCommand, CommandError

from incidents.canary.suite import CHECKS, canary_run, select_checks


def _names(value: str | None) -> list[str] | None:
    return [n.strip() for n in value.split(",") if n.strip()] if value else None


class Command(BaseCommand):
    help = "Run the canary checks now; exit status 0 only when all passed."

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
        self.stdout.write(f"canary run #{run.pk}: {'PASSED' if run.passed else 'FAILED'}")
        for check in run.checks:
            line = f"  [{'ok' if check['passed'] else 'FAIL'}] {check['name']} ({check['duration_s']:.1f}s)"
            if not check["passed"]:
                d = check["details"]
                line += f": {d.get('reason') or '; '.join(map(str, d.get('problems', [])))[:500]}"
                if d.get("incidents"):
                    line += f" (incidents {d['incidents']})"
            self.stdout.write(line)
        if options["json"]:
            self.stdout.write(json.dumps({"passed": run.passed, "run": run.pk, "checks": run.checks},
                                         separators=(",", ":"), default=str))
        self.stdout.flush()
        if not run.passed:
            sys.exit(1)
