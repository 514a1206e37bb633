"""Separate test hosts on this machine: one network namespace per host on a bridge of its own (veth pairs,
a private 10.213.N.0/24), and a redis-server of its own on the Redis host. Needs root (`ip netns`).

Every name carries a run id, so two runs never collide. A run records what it creates in
/tmp/kvchaos/<run>.json (owner pid and start time first); `Hosts.create` first sweeps the leftovers of
runs whose owner is dead, and only names of this suite's own shape (`kvchaos-*` namespaces,
`kch<run>*` links). `Hosts.close` removes everything of its run, the processes inside its namespaces
included.
"""
import fcntl
import ipaddress
import json
import os
import random
import re
import secrets
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

STATE_DIR = Path("/tmp/kvchaos")
NETNS_PREFIX = "kvchaos-"
LINK_RE = re.compile(r"^kch[0-9a-f]{6}(br|-\d+)$")  # bridge kch<run>br, root-side veth ends kch<run>-<i>
SUBNET = "10.213.{}.0/24"
REDIS_PORT = 6390


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/pid/stat): tells a live owner from a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@contextmanager
def _locked():
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def list_netns() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()]


def list_links() -> list[str]:
    out = sh("ip", "-o", "link", "show").stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def netns_pids(netns: str) -> list[int]:
    out = sh("ip", "netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_netns(netns: str) -> None:
    """SIGKILL every process inside the namespace (ours: only this suite starts processes there), then delete it."""
    for _ in range(50):
        pids = netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped process dies only once continued
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    sh("ip", "netns", "del", netns, check=False)


def _owner_alive(state: dict) -> bool:
    started = state.get("start_time")
    return started is not None and _start_time(state.get("pid", -1)) == started


def sweep_stale() -> list[str]:
    """Removes the namespaces and links of runs whose owner process is gone; returns what it removed."""
    removed = []
    with _locked():
        live_runs = set()
        for path in STATE_DIR.glob("*.json"):
            try:
                state = json.loads(path.read_text())
            except ValueError:
                state = {}
            if _owner_alive(state):
                live_runs.add(path.stem)
            else:
                path.unlink(missing_ok=True)
        for netns in list_netns():
            if netns.startswith(NETNS_PREFIX) and netns.split("-")[1] not in live_runs:
                _kill_netns(netns)
                removed.append(netns)
        for link in list_links():
            if LINK_RE.match(link) and link[3:9] not in live_runs:
                sh("ip", "link", "del", link, check=False)
                removed.append(link)
    return removed


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    addr: str
    link: str  # the root-side end of its veth pair, on the bridge


class Hosts:
    """One namespace per named host, all on one bridge; the root namespace (the harness, the clients)
    holds the bridge's address, .1."""

    def __init__(self, names: list[str]):
        self.run = secrets.token_hex(3)
        self.names = list(names)
        self.bridge = f"kch{self.run}br"
        self.hosts: dict[str, Host] = {}
        self.gateway = ""
        self._state = STATE_DIR / f"{self.run}.json"

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = set(re.findall(r"inet 10\.213\.(\d+)\.", sh("ip", "-o", "-4", "addr", "show").stdout))
        for path in STATE_DIR.glob("*.json"):
            try:
                used.add(json.loads(path.read_text()).get("subnet", "").split(".")[2])
            except (ValueError, IndexError):
                continue
        free = [n for n in range(1, 255) if str(n) not in used]
        if not free:
            raise RuntimeError("no free 10.213.N.0/24 subnet for the chaos hosts")
        return ipaddress.ip_network(SUBNET.format(random.choice(free)))

    def _save(self, subnet) -> None:
        self._state.write_text(json.dumps({
            "pid": os.getpid(), "start_time": _start_time(os.getpid()), "subnet": str(subnet),
            "bridge": self.bridge, "hosts": {n: asdict(h) for n, h in self.hosts.items()}}))

    def create(self) -> "Hosts":
        sweep_stale()
        with _locked():
            subnet = self._pick_subnet()
            addrs = list(subnet.hosts())
            self.gateway = str(addrs[0])
            self.hosts = {name: Host(name, f"{NETNS_PREFIX}{self.run}-{name}", str(addrs[i + 1]),
                                     f"kch{self.run}-{i}") for i, name in enumerate(self.names)}
            self._save(subnet)  # before anything exists: a crash from here on leaves a record to sweep
        try:
            # a fixed address: otherwise a bridge takes its ports' lowest, which moves as ports come and go
            mac = "02:" + ":".join(self.run[i:i + 2] for i in range(0, 6, 2)) + ":00:01"
            sh("ip", "link", "add", self.bridge, "address", mac, "type", "bridge")
            sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for host in self.hosts.values():
                sh("ip", "netns", "add", host.netns)
                sh("ip", "link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                sh("ip", "link", "set", host.link, "master", self.bridge)
                sh("ip", "link", "set", host.link, "up")
                sh("ip", "-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
                sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
                sh("ip", "-n", host.netns, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise
        return self

    def exec_prefix(self, name: str) -> list[str]:
        """Runs a command on host `name`: `ip netns exec` execs in place, so the pid is the command's own."""
        return ["ip", "netns", "exec", self.hosts[name].netns]

    def cut(self, name: str) -> None:
        """Cuts the host off the network: its veth's bridge end goes down, so every packet it sends is
        dropped silently (its address and routes stay, its sockets see no error, as in a partition)."""
        sh("ip", "link", "set", self.hosts[name].link, "down")

    def restore(self, name: str) -> None:
        sh("ip", "link", "set", self.hosts[name].link, "up")

    def close(self) -> None:
        with _locked():
            for host in self.hosts.values():
                if host.netns in list_netns():
                    _kill_netns(host.netns)
            for link in list_links():
                if link.startswith(f"kch{self.run}") and LINK_RE.match(link):
                    sh("ip", "link", "del", link, check=False)
            self._state.unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        """This run's namespaces, links and state file that still exist (empty after close)."""
        left = [n for n in list_netns() if n.startswith(f"{NETNS_PREFIX}{self.run}-")]
        left += [link for link in list_links() if link.startswith(f"kch{self.run}")]
        return left + ([str(self._state)] if self._state.exists() else [])


class RedisHost:
    """A redis-server of the suite's own on its host: no persistence, so a restart comes back empty."""

    def __init__(self, hosts: Hosts, name: str, workdir: Path, port: int = REDIS_PORT):
        self.hosts, self.name, self.port = hosts, name, port
        self.addr = hosts.hosts[name].addr
        self.dir = Path(workdir) / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://{self.addr}:{port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20) -> None:
        log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [*self.hosts.exec_prefix(self.name), "redis-server", "--port", str(self.port), "--bind", self.addr,
             "127.0.0.1", "--protected-mode", "no", "--dir", str(self.dir), "--save", "", "--appendonly", "no",
             "--maxmemory-policy", "noeviction", "--daemonize", "no", "--logfile", ""],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.client(timeout_s=1).ping():
                    return
            except redis.RedisError:
                time.sleep(0.1)
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"redis-server on {self.name} did not answer: {(self.dir / 'redis.log').read_text()[-2000:]}")

    def client(self, timeout_s: float | None = 10) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self, ms: int) -> None:
        """CLIENT PAUSE for `ms` (ALL: reads too); Redis resumes by itself when it runs out."""
        self.client().execute_command("CLIENT", "PAUSE", int(ms), "ALL")
