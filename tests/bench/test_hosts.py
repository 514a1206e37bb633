"""bench/hosts.py on the real kernel (root): namespaces on a bridge reach each other, a cut host's packets are
dropped, close() leaves nothing, and the stale sweep removes only runs whose owner process is gone."""
import json
import socket
import subprocess
import sys
import time

import pytest

from bench.hosts import Hosts, _start_time, list_netns, sweep_stale

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()"


@pytest.fixture
def hosts():
    h = Hosts(["a", "b"]).create()
    try:
        yield h
    finally:
        h.close()


def connects(hosts: Hosts, name: str, addr: str, port: int, within_s: float = 0) -> bool:
    """A TCP connection from host `name` succeeds (retried for `within_s`: a neighbour entry that failed
    during a cut answers "no route" for about a second after the link is back, as on a real network)."""
    cmd = [*hosts.exec_prefix(name), sys.executable, "-c", CONNECT, addr, str(port)]
    deadline = time.monotonic() + within_s
    while True:
        if subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def test_hosts_reach_the_root_namespace_until_cut(hosts):
    with socket.create_server((hosts.gateway, 0)) as server:
        port = server.getsockname()[1]
        assert connects(hosts, "a", hosts.gateway, port)
        hosts.cut("a")
        assert not connects(hosts, "a", hosts.gateway, port)
        assert connects(hosts, "b", hosts.gateway, port)
        hosts.restore("a")
        assert connects(hosts, "a", hosts.gateway, port, within_s=10)


def test_close_removes_namespaces_links_processes_and_the_record():
    h = Hosts(["a"]).create()
    sleeper = subprocess.Popen([*h.exec_prefix("a"), "sleep", "600"])
    assert h.leftovers()
    h.close()
    assert sleeper.wait(timeout=10) != 0
    assert h.leftovers() == []


def test_the_sweep_removes_runs_of_dead_owners_and_keeps_live_ones(hosts):
    dead = Hosts(["a"]).create()
    try:
        state = json.loads(dead._state.read_text())
        gone = subprocess.Popen(["true"])
        gone.wait()
        state.update(pid=gone.pid, start_time=_start_time(gone.pid) or "0")
        dead._state.write_text(json.dumps(state))
        removed = sweep_stale()
        assert dead.hosts["a"].netns in removed and dead.leftovers() == []
        assert hosts.hosts["a"].netns in list_netns() and hosts._state.exists()  # its owner (this process) lives
    finally:
        dead.close()
