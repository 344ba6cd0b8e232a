"""Native CPU kernels (``kernels/cpu/*.cpp``): built on first use with the system's C++
compiler for this CPU (``-O3 -march=native``), cached, and loaded with ctypes.

No build step at install: the first process that asks compiles (a few seconds) into
``$GENREC_NATIVE_CACHE`` (default ``~/.cache/genrec/native``), under a name keyed by the
source, the flags, the compiler and the CPU, so a changed source or another machine never
loads a stale library; later processes load it. Where no compiler works, or
``GENREC_NATIVE=0``, :func:`library` returns None and callers keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("genrec.kernels")
SOURCES = Path(__file__).parent / "cpu"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
# per library: the training attention and the bf16 SiLU passes split their work between OpenMP
# threads, which (built against libgomp, as PyTorch's CPU wheels are) are PyTorch's own pool,
# not a second one
EXTRA_FLAGS: dict[str, tuple[str, ...]] = {"hstu_train": ("-fopenmp",), "bf16_ops": ("-fopenmp",)}


def enabled() -> bool:
    return os.environ.get("GENREC_NATIVE", "1") != "0"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.platform() + platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("GENREC_NATIVE_CACHE", Path.home() / ".cache" / "genrec" / "native"))


def library(name: str) -> ctypes.CDLL | None:
    """The compiled ``kernels/cpu/<name>.cpp``, or None (disabled, no compiler, or the build
    failed: logged once)."""
    return _build(name) if enabled() else None


@functools.cache
def _build(name: str) -> ctypes.CDLL | None:
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler found: native kernels off, the PyTorch path serves")
        return None
    src = SOURCES / f"{name}.cpp"
    flags = (*FLAGS, *EXTRA_FLAGS.get(name, ()))
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    headers = [h.read_text() for h in sorted(SOURCES.glob("*.h"))]  # what a source may #include
    key = hashlib.sha256("\0".join([src.read_text(), *headers, " ".join(flags), version, _cpu_id()]).encode()
                         ).hexdigest()[:16]
    out = _cache_dir() / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # built aside, renamed in: atomic
        os.close(fd)
        try:
            res = subprocess.run([cxx, *flags, "-o", tmp, str(src)], capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                log.warning("building %s failed, the PyTorch path serves:\n%s", src.name, res.stderr[-2000:])
                return None
            os.replace(tmp, out)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("building %s failed (%s), the PyTorch path serves", src.name, e)
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(out))
