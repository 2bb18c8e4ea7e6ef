"""Fixtures for the Python tests: a real moesnapd per test, started and SIGKILLed like in
production, and the example MoE trainer as a real process."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

BIN_DIR = Path(os.environ.get("MOESNAP_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
TRAINER = Path(__file__).resolve().parents[1] / "examples" / "moe_train.py"


class Daemon:
    """A moesnapd with its own pool and sockets; restarts re-attach the same pool."""

    def __init__(self, directory: Path, node_id: int = 0, extra_config: str = "") -> None:
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
            f'[pool]\nname = "{self.pool}"\nbytes = "256MiB"\nlock = "off"\n' + extra_config)
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


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Etcd:
    """A one-member etcd on free loopback ports with a temporary data folder, for cluster tests."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="moesnap-pytest-etcd-")
        self.client_port, peer_port = unused_port(), unused_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self.log = open(Path(self.directory) / "etcd.log", "w")
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
                raise RuntimeError(f"etcd exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as answer:
                    if json.loads(answer.read()).get("health") == "true":
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("etcd did not start serving")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


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
