"""bench.fairness's hop breakdown: B's ChatRequest timestamps (as the stack's SQLite database stores them) turned
into queue / prefill / handoff / decode milliseconds, only B's rows, only those created after the phase began, and
rows with a missing stamp (a failed or unfinished request) left out."""
import sqlite3
from types import SimpleNamespace

from bench.fairness import HOPS, b_hops
from tests.e2e.stack import Stack


class SqliteStack(SimpleNamespace):
    sql = Stack.sql  # the bench's own query path, on a real SQLite file


def test_b_hops_reads_only_bs_rows_after_the_phase_began(tmp_path):
    db = tmp_path / "db.sqlite3"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE tenants_tenant (id INTEGER PRIMARY KEY, name TEXT)")
        con.execute("CREATE TABLE chat_chatrequest (id TEXT PRIMARY KEY, tenant_id INTEGER, created_at TEXT, "
                    "prefill_started_at TEXT, prefill_finished_at TEXT, decode_started_at TEXT, finished_at TEXT)")
        con.executemany("INSERT INTO tenants_tenant VALUES (?, ?)", [(1, "bench-A"), (2, "bench-B")])
        day = "2026-12-07 18:49:"
        con.executemany("INSERT INTO chat_chatrequest VALUES (?, ?, ?, ?, ?, ?, ?)", [
            ("z-old", 2, day + "40.000000", day + "40.010000", day + "40.020000", day + "40.030000", day + "40.040000"),
            ("a-new", 2, day + "41.000000", day + "41.007000", day + "41.018000", day + "41.024000", day + "41.045000"),
            ("m-new", 2, day + "42.000000", day + "42.005000", day + "42.015000", day + "42.020000", day + "42.050000"),
            ("b-fail", 2, day + "43.000000", day + "43.005000", None, None, day + "43.010000"),
            ("c-tenant-a", 1, day + "44.000000", day + "44.100000", day + "44.200000", day + "44.300000",
             day + "44.400000"),
        ])
    stack = SqliteStack(env={"DATABASE_URL": f"sqlite:///{db}"})
    hops = b_hops(stack, day + "40.500000")
    assert set(hops) == set(HOPS)
    got = {hop: [round(x, 3) for x in xs] for hop, xs in hops.items()}
    assert got == {"queue_ms": [7.0, 5.0], "prefill_ms": [11.0, 10.0], "handoff_ms": [6.0, 5.0],
                   "decode_ms": [21.0, 30.0]}
