"""The PEP 517 backend that builds the moesnap wheel (``pyproject.toml`` names it), offline.

The wheel holds the pure-Python package and, in ``moesnap/_lib/``, the native library libmoesnap_c
(the C ABI, loaded with ctypes) with every shared library it needs, as auditwheel would repair it:
each bundled library gets a content-hashed name (so it never stands in for, or is stood in for by,
another copy of that library in the process, say a framework's libprotobuf) and the run path
``$ORIGIN``. Only libc, libm, libstdc++, libgcc_s and the dynamic loader are left to the system.
The platform tag is the oldest manylinux whose glibc and libstdc++ provide every versioned symbol
the bundle uses.

The native library comes from the CMake build: ``-C native-library=build/lib/libmoesnap_c.so.2``
(``deploy/build.sh`` builds the wheel into build/wheel/ by itself), and so does, where the build
found torch's c10 headers, the storage library ``-C storage-library=.../libmoesnap_torch_storage.so``
(client/python/native/torch_storage.h), which needs only the system's libraries and goes in as it
is. Needs ldd, objdump, strip and patchelf on PATH.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

_SOURCE = Path(__file__).resolve().parents[1]  # client/python, beside pyproject.toml
_PACKAGE = "moesnap"
_LIB_DIR = f"{_PACKAGE}/_lib"
# Left to the system: what every glibc Linux has, and what a process must share with the
# interpreter and its other extensions (one libstdc++, one libgcc_s).
_SYSTEM_LIBRARIES = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                     "ld-linux-x86-64.so.2", "linux-vdso.so.1"}
# The newest version of each versioned library a manylinux tag guarantees on x86-64, from the
# manylinux policies (PEP 600; auditwheel's policy file); oldest tag first.
_MANYLINUX = [
    ("manylinux_2_28",
     {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}),
    ("manylinux_2_31",
     {"GLIBC": (2, 31), "GLIBCXX": (3, 4, 28), "CXXABI": (1, 3, 12), "GCC": (7, 0, 0)}),
    ("manylinux_2_34",
     {"GLIBC": (2, 34), "GLIBCXX": (3, 4, 29), "CXXABI": (1, 3, 13), "GCC": (7, 0, 0)}),
    ("manylinux_2_35",
     {"GLIBC": (2, 35), "GLIBCXX": (3, 4, 30), "CXXABI": (1, 3, 13), "GCC": (12, 0, 0)}),
    ("manylinux_2_36",
     {"GLIBC": (2, 36), "GLIBCXX": (3, 4, 30), "CXXABI": (1, 3, 13), "GCC": (12, 0, 0)}),
]
_STORAGE_LIBRARY = "libmoesnap_torch_storage.so"  # the name moesnap/_storage.py loads
_VERSIONED = re.compile(r"\((GLIBC|GLIBCXX|CXXABI|GCC)_([0-9.]+)\)")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so that the same inputs give the same wheel


class BuildError(Exception):
    pass


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _project() -> dict:
    with open(_SOURCE / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]


def _dependencies(library: Path) -> Dict[str, Path]:
    """soname -> file of every library `library` loads, directly or not (ldd resolves them as the
    loader would, through run paths)."""
    found = {}
    for line in _run("ldd", str(library)).splitlines():
        match = re.match(r"\s*(\S+) => (\S+)", line)
        if match and match.group(2) == "not":
            raise BuildError(f"{library} needs {match.group(1)}, which is not found")
        if match:
            found[match.group(1)] = Path(match.group(2))
    return found


def _needed(library: Path) -> List[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+)\]", _run("readelf", "-d", str(library)))


def _hashed_name(soname: str, content: bytes) -> str:
    """libprotobuf.so.32 -> libprotobuf-1a2b3c4d.so.32 (auditwheel's naming)."""
    stem, dot, rest = soname.partition(".so")
    return f"{stem}-{hashlib.sha256(content).hexdigest()[:8]}{dot}{rest}"


def _bundle(native: Path, into: Path) -> List[Path]:
    """Copies the native library and what it needs into `into`, renamed and with $ORIGIN run
    paths; returns the files."""
    entry = _soname(native)
    libraries = {entry: native}
    for soname, path in _dependencies(native).items():
        if soname not in _SYSTEM_LIBRARIES:
            libraries[soname] = path
    names = {}
    for soname, path in libraries.items():
        target = into / soname
        shutil.copyfile(path, target)
        _run("strip", "--strip-debug", str(target))
        names[soname] = soname if soname == entry else _hashed_name(soname, target.read_bytes())
    files = []
    for soname, name in names.items():
        path = into / soname
        # One change per patchelf run: patchelf 0.14 garbles the string table when one run both
        # renames the library and replaces what it needs.
        changes = [["--set-rpath", "$ORIGIN"]]
        if name != soname:
            changes.append(["--set-soname", name])
        for needed in _needed(path):
            if needed in names and names[needed] != needed:
                changes.append(["--replace-needed", needed, names[needed]])
            elif needed not in names and needed not in _SYSTEM_LIBRARIES:
                raise BuildError(f"{soname} needs {needed}, which is neither bundled nor one of "
                                 f"the system's {sorted(_SYSTEM_LIBRARIES)}")
        for change in changes:
            _run("patchelf", *change, str(path))
        path.rename(into / name)
        files.append(into / name)
    return files


def _storage_library(library: Path, into: Path) -> Path:
    """The storage library in `into`, under the name the package loads it by."""
    target = into / _STORAGE_LIBRARY
    shutil.copyfile(library, target)
    _run("strip", "--strip-debug", str(target))
    _run("patchelf", "--set-rpath", "$ORIGIN", str(target))
    for needed in _needed(target):
        if needed not in _SYSTEM_LIBRARIES:
            raise BuildError(f"{library} needs {needed}, which is not one of the system's "
                             f"{sorted(_SYSTEM_LIBRARIES)}")
    return target


def _soname(library: Path) -> str:
    match = re.search(r"\(SONAME\)\s+Library soname: \[(.+)\]", _run("readelf", "-d", str(library)))
    if not match:
        raise BuildError(f"{library} has no soname")
    return match.group(1)


def _symbol_versions(files: List[Path]) -> Dict[str, Tuple[int, ...]]:
    """The newest version of each versioned system library any file uses (undefined symbols)."""
    newest: Dict[str, Tuple[int, ...]] = {}
    for path in files:
        for line in _run("objdump", "-T", str(path)).splitlines():
            if "*UND*" not in line:
                continue
            match = _VERSIONED.search(line)
            if match:
                version = tuple(int(part) for part in match.group(2).split("."))
                newest[match.group(1)] = max(newest.get(match.group(1), ()), version)
    return newest


def _platform_tag(files: List[Path]) -> str:
    used = _symbol_versions(files)
    for tag, provided in _MANYLINUX:
        if all(version <= provided[library] for library, version in used.items()):
            return f"{tag}_x86_64"
    return "linux_x86_64"  # honest: newer than any manylinux policy we know


def _check_loads(library: Path, version: str) -> None:
    """The bundled library loads from its own folder and is this release."""
    loaded = ctypes.CDLL(str(library))
    loaded.moesnap_version.restype = ctypes.c_char_p
    found = loaded.moesnap_version().decode()
    if found != version:
        raise BuildError(f"{library} is release {found}, pyproject.toml says {version}")


def _record_line(name: str, content: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(content)}"


def _metadata(project: dict) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}",
             f"Summary: {project['description']}",
             f"Requires-Python: {project['requires-python']}"]
    for requirement in project.get("dependencies", []):
        lines.append(f"Requires-Dist: {requirement}")
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f"Requires-Dist: {requirement}; extra == \"{extra}\""
                  for requirement in requirements]
    return "\n".join(lines) + "\n"


def _write_wheel(path: Path, files: List[Tuple[str, bytes, bool]], dist_info: str) -> None:
    """A wheel holding `files` (archive name, content, executable) and a RECORD of them."""
    record = [_record_line(name, content) for name, content, _ in files]
    record.append(f"{dist_info}/RECORD,,")
    files = files + [(f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode(), False)]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for name, content, executable in files:
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = (0o755 if executable else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, content)


def build_wheel(wheel_directory: str, config_settings: Optional[dict] = None,
                metadata_directory: Optional[str] = None) -> str:
    native = (config_settings or {}).get("native-library")
    storage = (config_settings or {}).get("storage-library")
    if not native:
        raise BuildError("give the native library: -C native-library=build/lib/libmoesnap_c.so.2 "
                         "(deploy/build.sh builds it, and the wheel, into build/)")
    project = _project()
    name, version = project["name"], project["version"]
    with tempfile.TemporaryDirectory(prefix="moesnap-wheel-") as scratch:
        bundled = _bundle(Path(native).resolve(), Path(scratch))
        _check_loads(Path(scratch) / _soname(Path(native).resolve()), version)
        if storage:
            bundled.append(_storage_library(Path(storage).resolve(), Path(scratch)))
        tag = _platform_tag(bundled)
        files = [(f"{_PACKAGE}/{source.name}", source.read_bytes(), False)
                 for source in sorted((_SOURCE / _PACKAGE).glob("*.py"))]
        files += [(f"{_LIB_DIR}/{library.name}", library.read_bytes(), True)
                  for library in sorted(bundled)]
    dist_info = f"{name}-{version}.dist-info"
    files.append((f"{dist_info}/METADATA", _metadata(project).encode(), False))
    files.append((f"{dist_info}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: moesnap_wheel\n"
                                         f"Root-Is-Purelib: false\nTag: py3-none-{tag}\n").encode(),
                  False))
    wheel_name = f"{name}-{version}-py3-none-{tag}.whl"
    _write_wheel(Path(wheel_directory) / wheel_name, files, dist_info)
    return wheel_name


def get_requires_for_build_wheel(config_settings: Optional[dict] = None) -> List[str]:
    return []
