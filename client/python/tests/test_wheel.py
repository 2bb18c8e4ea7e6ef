"""The wheel as a user installs it: its RECORD, what its native libraries need from the system,
and the core API (no PyTorch) in a fresh virtual environment of the first python3 on PATH, against
a real moesnapd, through a SIGKILLed trainer and a restore in a fresh process. (The PyTorch tests
import the same wheel, installed into build/python, under Debian's python and torch.)"""

import ast
import base64
import hashlib
import os
import re
import shutil
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest

from conftest import ChildProcess, Daemon

WHEEL_DIR = Path(os.environ.get("MOESNAP_WHEEL_DIR",
                                Path(__file__).resolve().parents[3] / "build" / "wheel"))
RAW_TRAINER = Path(__file__).resolve().parent / "raw_trainer.py"
README = Path(__file__).resolve().parents[3] / "README.md"
# What the native libraries may take from the system: glibc's libc and libm, the one libstdc++ and
# libgcc_s every C++ extension in the process shares, and the dynamic loader.
SYSTEM = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2"}


@pytest.fixture(scope="module")
def wheel() -> Path:
    wheels = sorted(WHEEL_DIR.glob("moesnap-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {WHEEL_DIR}, found {wheels}"
    return wheels[0]


@pytest.fixture(scope="module")
def libraries(wheel: Path, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wheel")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(directory)
    return directory / "moesnap" / "_lib"


def readelf(path: Path) -> str:
    return subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True,
                          text=True).stdout


def test_record_lists_every_file_with_its_hash_and_the_tag_matches(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/RECORD"))
        recorded = set()
        for line in archive.read(f"{dist_info}/RECORD").decode().splitlines():
            name, digest, size = line.rsplit(",", 2)
            recorded.add(name)
            if name == f"{dist_info}/RECORD":
                continue
            content = archive.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=")
            assert digest == f"sha256={expected.decode()}" and int(size) == len(content), name
        assert recorded == names
        tags = re.findall(r"^Tag: (.+)$", archive.read(f"{dist_info}/WHEEL").decode(), re.M)
        metadata = archive.read(f"{dist_info}/METADATA").decode()
    assert tags == [wheel.stem.split("-", 2)[2]]
    assert tags[0].startswith("py3-none-manylinux_2_")
    assert "Requires-Python: >=3.9" in metadata
    assert "moesnap/_lib/libmoesnap_c.so.2" in names
    # The README states the glibc floor of the wheel it documents.
    assert tags[0].removeprefix("py3-none-").removesuffix("_x86_64") in README.read_text()


def test_python_sources_are_python_3_9(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        sources = [name for name in archive.namelist() if name.endswith(".py")]
        assert "moesnap/core.py" in sources
        for name in sources:
            ast.parse(archive.read(name), name, feature_version=(3, 9))


def test_native_libraries_need_only_what_the_wheel_ships_and_the_c_runtime(wheel: Path,
                                                                          libraries: Path):
    shipped = {path.name for path in libraries.iterdir()}
    assert "libmoesnap_c.so.2" in shipped
    for path in libraries.iterdir():
        dynamic = readelf(path)
        needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+)\]", dynamic))
        assert needed <= shipped | SYSTEM, (path.name, sorted(needed - shipped - SYSTEM))
        assert re.findall(r"\(RUNPATH\)\s+Library runpath: \[(.+)\]", dynamic) == ["$ORIGIN"], \
            path.name
    # The storage library is compiled against c10's headers but calls nothing of torch: every
    # symbol it takes from elsewhere is a versioned one of the C and C++ runtimes.
    assert "libmoesnap_torch_storage.so" in shipped
    symbols = subprocess.run(["objdump", "-T", str(libraries / "libmoesnap_torch_storage.so")],
                             check=True, capture_output=True, text=True).stdout
    undefined = [line for line in symbols.splitlines() if "*UND*" in line and " w " not in line]
    assert undefined and all(re.search(r"\((GLIBC|GLIBCXX|CXXABI|GCC)_[0-9.]+\)", line)
                             for line in undefined), undefined
    # The platform tag promises a glibc: no library uses a newer symbol version.
    floor = tuple(int(part) for part in re.search(r"manylinux_(\d+)_(\d+)", wheel.name).groups())
    for path in libraries.iterdir():
        symbols = subprocess.run(["objdump", "-T", str(path)], check=True, capture_output=True,
                                 text=True).stdout
        for major, minor in re.findall(r"\(GLIBC_(\d+)\.(\d+)", symbols):
            assert (int(major), int(minor)) <= floor, (path.name, major, minor)


def test_core_api_in_a_fresh_virtual_environment_survives_a_killed_trainer(
        wheel: Path, daemon: Daemon, tmp_path: Path):
    # Nothing of this build's package on the path: only what the wheel installs.
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    python = shutil.which("python3")  # the first on PATH: a separately built one where there is
    venv = tmp_path / "venv"          # one, else Debian's; either way without its site packages
    subprocess.run([python, "-m", "venv", str(venv)], check=True, env=environment)
    venv_python = str(venv / "bin" / "python")
    pip = [venv_python, "-m", "pip", "--quiet", "--disable-pip-version-check", "--no-cache-dir"]
    subprocess.run(pip + ["install", "--no-index", "--no-deps", str(wheel)], check=True,
                   env=environment)
    version = subprocess.run([venv_python, "-c", "import sys; print(sys.version)"], check=True,
                             capture_output=True, text=True, env=environment).stdout
    print(f"virtual environment of {python}: Python {version}")
    no_torch = subprocess.run([venv_python, "-c", "import moesnap; moesnap.Client"],
                              capture_output=True, text=True, env=environment)
    assert no_torch.returncode != 0 and "moesnap.Client needs PyTorch" in no_torch.stderr, \
        no_torch.stderr

    trainer = ChildProcess([venv_python, str(RAW_TRAINER), "train", daemon.agent_socket],
                           env=environment)
    source = trainer.wait_for(r"moesnap from .*")
    assert trainer.lines[source].startswith(f"moesnap from {venv}"), trainer.lines[source]
    trainer.wait_for(r"committed 3")
    trainer.wait_for(r"snapshot 6")
    trainer.process.send_signal(signal.SIGKILL)
    trainer.process.wait()

    restore = ChildProcess([venv_python, str(RAW_TRAINER), "restore", daemon.agent_socket],
                           env=environment)
    lines = restore.finish(timeout=60)
    match = re.fullmatch(r"restored (\d+) gpu (\S+) cuda loaded (\w+)", lines[-1])
    assert match, lines
    assert int(match.group(1)) >= 3
    assert match.group(2) == "FAILED_PRECONDITION"  # no CUDA copy backend in this daemon
    assert match.group(3) == "False"  # nothing of CUDA was loaded
