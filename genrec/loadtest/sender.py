"""The native sender (``cpp/sender.cc``): the load generator's open-loop schedule sent from C++.

Why: the Python sender (:func:`genrec.loadtest.runner.run_step`) spends about as much CPU on
a call as a small server call does, so one core of it cannot offer several times a fast
server's capacity on time, nor time the answers (benchmarks/notes/2026-12-05-resilience-generator.md).
The C++ sender, on gRPC's C++ generic stub, sends the same schedule and payloads and hands back
each call's times, status and reply; :func:`genrec.loadtest.runner.native_step` turns them
into the same :class:`~genrec.loadtest.results.StepResult`.

Built on first use against the system's gRPC C++ library (:mod:`genrec.native_build`;
Debian: ``apt-get install libgrpc++-dev``); :func:`binary` raises
:class:`~genrec.native_build.NativeBuildError` naming what is missing.
"""

from __future__ import annotations

import functools
import struct
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from genrec.native_build import build_program, unavailable

SOURCE = Path(__file__).parent / "cpp" / "sender.cc"
RECORD = struct.Struct("<dddiI")  # scheduled s, latency s, lateness s, status code, reply length
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


@functools.cache
def binary() -> Path:
    """The built sender (built now if this source, compiler and library have none yet)."""
    return build_program(SOURCE)


def available() -> str | None:
    """None where the native sender builds, else why not."""
    return unavailable(binary)


def choose(requested: str) -> tuple[str, str | None]:
    """(the sender to use, why not the native one or None) for ``--sender``: "native" where it
    builds, else (for "auto") "python"; asking for "native" where it does not build exits."""
    why = available() if requested != "python" else None
    if why is not None and requested == "native":
        raise SystemExit(why)
    return ("native" if requested != "python" and why is None else "python"), why


@dataclass
class Answers:
    """What the sender sent and got back, in schedule order."""

    offsets: list[float]  # scheduled send times, seconds from the step's start
    took: list[float]  # latency from the scheduled time, seconds
    late: list[float]  # how late each call was sent, seconds
    codes: list[str]  # gRPC status code names
    replies: list[bytes | None]  # the reply of an OK call (when asked for), else None


def send(target: str, method: str, payloads: Sequence[bytes], offsets: Sequence[float], timeout_s: float,
         warmup: int = 20, first: int = 0, replies: bool = True,
         metadata: tuple[tuple[str, str], ...] = (), began: threading.Event | None = None) -> Answers:
    """Send ``offsets`` (seconds from the start) open-loop to ``target``'s ``method`` (the full
    path, ``/genrec.v1.Recommender/Recommend``): call i takes ``payloads[(first + i) % n]``,
    after ``warmup`` calls one at a time (``payloads[i % n]``). ``began`` is set once the
    warm-up is over (the schedule's origin is 50 ms later). Blocks until every call has its
    answer."""
    with tempfile.TemporaryDirectory(prefix="genrec-sender-") as tmp:
        folder = Path(tmp)
        with open(folder / "payloads", "wb") as f:
            for p in payloads:
                f.write(struct.pack("<I", len(p)))
                f.write(p)
        (folder / "schedule").write_bytes(struct.pack(f"<{len(offsets)}d", *offsets))
        cmd = [str(binary()), target, method, str(folder / "payloads"), str(folder / "schedule"), str(folder / "out"),
               f"{timeout_s * 1e3:.3f}", str(warmup), str(first), "1" if replies else "0",
               *(f"{k}={v}" for k, v in metadata)]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            for line in proc.stdout:
                if line.strip() == "sending" and began is not None:
                    began.set()
            err = proc.stderr.read()
        if proc.returncode != 0:
            raise RuntimeError(f"the native sender failed ({proc.returncode}): {err.strip()[-1500:]}")
        raw = (folder / "out").read_bytes()
    out = Answers([], [], [], [], [])
    at = 0
    while at < len(raw):
        offset, took, late, code, n = RECORD.unpack_from(raw, at)
        at += RECORD.size
        out.offsets.append(offset)
        out.took.append(took)
        out.late.append(late)
        out.codes.append(CODE_NAMES.get(code, str(code)))
        out.replies.append(raw[at:at + n] if code == 0 and replies else None)
        at += n
    return out
