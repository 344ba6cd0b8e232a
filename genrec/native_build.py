"""Build a small C++ program against a system library found by pkg-config, on first use.

The load tests' sender (``genrec/loadtest/cpp/sender.cc``) and the server's front end
(``serve/cpp/front.cc``) are C++ programs on gRPC's C++ library (Debian: ``libgrpc++-dev``).
:func:`build_program` compiles one with the system's compiler into ``$GENREC_NATIVE_CACHE``
(default ``~/.cache/genrec/native``), under a name keyed by the source, flags, compiler and
library version, so a changed source or another machine never runs a stale build; later calls
return the cached file. Anything missing raises :class:`NativeBuildError` naming it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

FLAGS = ("-O2", "-std=c++17", "-pthread")


class NativeBuildError(RuntimeError):
    """No compiler, no library, or the build failed."""


def _run(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise NativeBuildError(f"{' '.join(cmd[:2])} failed: {res.stderr.strip()[-1500:]}")
    return res.stdout


def build_program(source: Path, library: str = "grpc++", hint: str = "on Debian: apt-get install libgrpc++-dev") -> Path:
    """The executable built from ``source`` against ``library`` (built now if not cached)."""
    cxx = next((shutil.which(c) for c in (os.environ.get("CXX"), "c++", "g++") if c and shutil.which(c)), None)
    if cxx is None or shutil.which("pkg-config") is None:
        raise NativeBuildError(f"{source.name} needs a C++ compiler and pkg-config")
    try:
        lib_flags = _run(["pkg-config", "--cflags", "--libs", library]).split()
        version = _run(["pkg-config", "--modversion", library]) + _run([cxx, "--version"])
    except NativeBuildError as e:
        raise NativeBuildError(f"{source.name} needs the {library} library ({e}); {hint}") from None
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(FLAGS), version]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("GENREC_NATIVE_CACHE", Path.home() / ".cache" / "genrec" / "native"))
    out = cache / f"{source.stem}-{key}"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache)  # built aside, renamed in: atomic
        os.close(fd)
        try:
            _run([cxx, *FLAGS, "-o", tmp, str(source), *lib_flags])
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def unavailable(binary: Callable[[], object]) -> str | None:
    """None where ``binary()`` (a program's build, cached) succeeds, else why not: what a caller
    that can fall back (or a test that skips) needs instead of the error."""
    try:
        binary()
    except NativeBuildError as e:
        return str(e)
    return None
