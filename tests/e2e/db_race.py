"""Processes racing on ChatRequest rows, for tests/e2e/test_database.py: `python -m tests.e2e.db_race MODE ARGS`
with DATABASE_URL set. Prints one JSON line. Modes:
  setup N            a tenant and N queued rows (ids race-0..N-1)
  claim N SEED       tries to claim every row once (QUEUED -> PREFILLING in one conditional UPDATE, as the
                     services' claims do), in a seeded order; prints the ids this process won
  increment K LOCK   K read-modify-write increments of race-0's prefill_deliveries, each in a transaction,
                     reading with select_for_update when LOCK is 1; a pause between read and write widens races
  read               race-0's prefill_deliveries
"""
import json
import os
import random
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")


def main(mode: str, *args: str) -> dict:
    import django

    django.setup()
    from django.db import transaction

    from kvserve.chat.models import ChatRequest
    from kvserve.tenants.models import Tenant

    Status = ChatRequest.Status
    if mode == "setup":
        tenant = Tenant.objects.create(name="race")
        ChatRequest.objects.bulk_create(ChatRequest(id=f"race-{i}", tenant=tenant, model="m", prompt_hash="x")
                                        for i in range(int(args[0])))
        return {"rows": ChatRequest.objects.count()}
    if mode == "claim":
        ids = [f"race-{i}" for i in range(int(args[0]))]
        random.Random(int(args[1])).shuffle(ids)
        won = []
        for rid in ids:
            with transaction.atomic():
                if ChatRequest.objects.filter(id=rid, status=Status.QUEUED).update(status=Status.PREFILLING):
                    won.append(rid)
        return {"won": won}
    if mode == "increment":
        rows = ChatRequest.objects.select_for_update() if args[1] == "1" else ChatRequest.objects
        for _ in range(int(args[0])):
            with transaction.atomic():
                row = rows.get(id="race-0")
                time.sleep(0.02)
                row.prefill_deliveries += 1
                row.save(update_fields=["prefill_deliveries"])
        return {"done": int(args[0])}
    if mode == "read":
        return {"value": ChatRequest.objects.get(id="race-0").prefill_deliveries}
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
