"""Fixtures for the Python tests: a real moesnapd per test, started and SIGKILLed like in
production, and the example MoE trainer as a real process."""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

BIN_DIR = Path(os.environ.get("MOESNAP_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
TRAINER = Path(__file__).resolve().parents[1] / "examples" / "moe_train.py"


class Daemon:
    """A moesnapd with its own pool and sockets; restarts re-attach the same pool."""

    def __init__(self, directory: Path, node_id: int = 0, extra_config: str = "",
                 pool_bytes: str = "256MiB") -> None:
        self.directory = directory
        self.pool = f"moesnap-pytest-{os.getpid()}-{directory.name}"
        self.agent_socket = str(directory / "agent.sock")
        self.admin_socket = str(directory / "admin.sock")
        self.config = directory / "moesnapd.toml"
        self.config.write_text(
            f'[node]\nid = {node_id}\n'
            f'[agent]\nsocket = "{self.agent_socket}"\n[admin]\nsocket = "{self.admin_socket}"\n'
            # Port 0: a free port, so daemons of parallel tests never collide on the default one.
            f'[http]\naddress = "127.0.0.1:0"\n'
            f'[pool]\nname = "{self.pool}"\nbytes = "{pool_bytes}"\nlock = "off"\n' + extra_config)
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        self.process = subprocess.Popen([str(BIN_DIR / "moesnapd"), "--config", str(self.config)])
        wait_until_serving(self.process, self.admin_socket)

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def remove(self) -> None:
        self.kill()
        for suffix in (".data", ".journal"):
            Path(f"/dev/shm/{self.pool}{suffix}").unlink(missing_ok=True)


class ChildProcess:
    """A child process whose output lines (stdout and stderr) are collected as they come."""

    def __init__(self, command: List[str], env: Optional[Dict[str, str]] = None) -> None:
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=env)
        self.lines: List[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 120, after: int = 0) -> int:
        """Waits for a line from line ``after`` on that matches ``pattern``; returns its index."""
        deadline = time.monotonic() + timeout
        while True:
            for index in range(after, len(self.lines)):
                if re.fullmatch(pattern, self.lines[index]):
                    return index
            assert self.process.poll() is None or self._reader.is_alive(), \
                (pattern, "\n".join(self.lines))
            assert time.monotonic() < deadline, (pattern, "\n".join(self.lines))
            time.sleep(0.005)

    def finish(self, timeout: float = 180) -> List[str]:
        code = self.process.wait(timeout)
        self._reader.join(10)
        assert code == 0, "\n".join(self.lines)
        return self.lines


_handed_out_ports = set()
_port_draws = random.SystemRandom()  # unaffected by tests that seed `random`


def unused_port() -> int:
    """A loopback port nothing is bound to now, drawn from below the kernel's ephemeral range so
    that the kernel never hands it out itself (to a port-0 listener or an outgoing connection),
    and never the same twice in this process. Another test may still draw it first, rarely: whoever
    binds it then fails at start and draws again."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        end = int(ports.read().split()[0])
    while True:
        port = _port_draws.randrange(15000, end)
        if port in _handed_out_ports:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out_ports.add(port)
        return port


class Etcd:
    """A one-member etcd on free loopback ports with a temporary data folder, for cluster tests."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="moesnap-pytest-etcd-")
        self.log = open(Path(self.directory) / "etcd.log", "w")
        # A port drawn free may be bound by another process before etcd binds it: etcd then exits
        # at start, and draws fresh ports, twice at most.
        for _ in range(3):
            if self._start():
                return
        raise RuntimeError(f"etcd did not start serving: {self._log_tail()}")

    def _start(self) -> bool:
        self.client_port, peer_port = unused_port(), unused_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        shutil.rmtree(Path(self.directory) / "data", ignore_errors=True)
        self.process = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", str(Path(self.directory) / "data"),
             "--listen-client-urls", f"http://{self.endpoint}",
             "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"t={peer_url}", "--unsafe-no-fsync", "--log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as answer:
                    if json.loads(answer.read()).get("health") == "true":
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        self.process.kill()
        self.process.wait()
        return False

    def _log_tail(self) -> str:
        self.log.flush()
        return (Path(self.directory) / "etcd.log").read_text()[-2000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class Cluster:
    """Daemons of one job on loopback and their own etcd: node i is daemons[i], the nodes sorted by
    id form groups of k + m. The one place that knows how a test cluster is configured and
    started."""

    def __init__(self, directory: Path, nodes: int, data_units: int, parity_units: int,
                 node_config: Optional[Dict[int, str]] = None,
                 lease_ttl_ms: int = 2000, commit_timeout_ms: int = 8000,
                 pool_bytes: str = "256MiB") -> None:
        self.etcd = Etcd()
        # Every node the same section: each finds the others in etcd, on ports it picks itself.
        cluster = (f'[cluster]\njob = "pytest"\nnode_count = {nodes}\ndata_units = {data_units}\n'
                   f'parity_units = {parity_units}\nstripe_unit_bytes = "64KiB"\n'
                   f'lease_ttl_ms = {lease_ttl_ms}\ncommit_timeout_ms = {commit_timeout_ms}\n'
                   f'etcd_endpoints = ["{self.etcd.endpoint}"]\nadvertise_host = "127.0.0.1"\n'
                   'control_port = 0\ndata_port = 0\n'
                   # Plaintext peers on loopback, said explicitly (the C++ cluster tests run
                   # mutual TLS everywhere).
                   '[tls]\ninsecure = true\n')
        self.daemons: List[Daemon] = []
        for i in range(nodes):
            node_directory = directory / f"node{i}"
            node_directory.mkdir()
            self.daemons.append(Daemon(node_directory, i,
                                       (node_config or {}).get(i, "") + cluster, pool_bytes))
        for daemon in self.daemons:
            daemon.start()
        self.wait_until_live(nodes)

    def ctl(self, node: int, *arguments: str) -> str:
        return subprocess.run([str(BIN_DIR / "moesnapctl"), "--socket",
                               self.daemons[node].admin_socket, *arguments],
                              capture_output=True, text=True, check=True).stdout

    def wait_until_live(self, live: int, asking: int = 0, timeout: float = 60) -> None:
        """Waits until node ``asking`` sees ``live`` nodes live, answering and not rebuilding (a lost
        node's daemon stays live in etcd until its lease ends, but does not answer)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = json.loads(self.ctl(asking, "--json", "cluster", "status"))
            if sum(1 for node in status["nodes"]
                   if node["live"] and node.get("answered") and not node["rebuilding"]) == live:
                return
            time.sleep(0.1)
        raise AssertionError(f"the cluster did not settle with {live} live nodes")

    def lose(self, node: int) -> None:
        """Node ``node``'s daemon is SIGKILLed and its memory is gone."""
        self.daemons[node].remove()

    def replace(self, node: int) -> None:
        """A replacement daemon for ``node``, with an empty pool: it rebuilds from its group."""
        self.daemons[node].start()

    def remove(self) -> None:
        for daemon in self.daemons:
            daemon.remove()
        self.etcd.stop()


def wait_until_serving(process: subprocess.Popen, admin_socket: str, timeout: float = 20) -> None:
    """Waits until the daemon `process` answers operators on `admin_socket`: every socket is bound
    and served then (a socket file, or an agent socket that accepts, is not enough)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moesnapd exited with {process.returncode}")
        answer = subprocess.run([str(BIN_DIR / "moesnapctl"), "--socket", admin_socket, "status",
                                 "--json"], capture_output=True, text=True)
        if answer.returncode == 0 and json.loads(answer.stdout)["pid"] == process.pid:
            return
        time.sleep(0.02)
    raise RuntimeError("moesnapd did not start serving")


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with tempfile.TemporaryDirectory(prefix="moesnap-pytest-") as directory:
        started = Daemon(Path(directory))
        started.start()
        try:
            yield started
        finally:
            started.remove()


def start_trainer(steps: int, socket_path: Optional[str], out: Optional[Path] = None,
                  extra: Optional[List[str]] = None) -> subprocess.Popen:
    command: List[str] = [sys.executable, str(TRAINER), "--steps", str(steps)] + (extra or [])
    if socket_path:
        command += ["--socket", socket_path]
    if out:
        command += ["--out", str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
