"""`manage.py setup_schedules`: the periodic tasks celery beat runs (django-celery-beat's DatabaseScheduler),
created once: the canary every 5 minutes, the reaper every KVSERVE_REAPER_INTERVAL_S (30) seconds, the history
sampler every KVSERVE_HISTORY_SAMPLE_S (15) seconds. Existing entries are left as an admin
edited them (interval, enabled); only a wrong task name is corrected. Edit them under Admin > Periodic tasks."""
from django.conf import settings
from django.core.management.base import BaseCommand
from django_celery_beat.models import IntervalSchedule, PeriodicTask


def schedules() -> tuple:
    # name, task, every, period, expire_seconds, description
    reaper_s = settings.KVSERVE_REAPER_INTERVAL_S
    history_s = max(1, int(settings.KVSERVE_HISTORY_SAMPLE_S))
    return (
        ("kvserve canary", "kvserve.canary", 5, IntervalSchedule.MINUTES, 300,
         "Canary suite: marker traffic, reproduction, handoff contract, integrity, worker config, self-test."),
        ("kvserve reaper", "kvserve.reap", reaper_s, IntervalSchedule.SECONDS, reaper_s,
         "Fail requests of gone workers and requests no worker took, retire the pools of gone workers."),
        ("kvserve history", "kvserve.history_sample", history_s, IntervalSchedule.SECONDS, history_s,
         "Sample throughput, TTFT, errors, 429s, queues, preemptions, prefix-cache hits and pool utilization."),
    )


class Command(BaseCommand):
    help = "Create the canary, reaper and history schedules for celery beat (idempotent)."

    def handle(self, *args, **options):
        for name, task, every, period, expire_s, description in schedules():
            interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=period)
            entry, created = PeriodicTask.objects.get_or_create(name=name, defaults={
                "task": task, "interval": interval, "expire_seconds": expire_s, "description": description})
            if not created and entry.task != task:
                entry.task = task
                entry.save(update_fields=["task"])
            state = "created" if created else "exists"
            self.stdout.write(f"{name}: {entry.task}, {entry.interval or entry.crontab} "
                              f"({'enabled' if entry.enabled else 'disabled'}, {state})")
