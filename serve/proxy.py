"""The native front end (``serve.connections.front_end = "native"``): overload shed in C++.

Why: under overload most calls must be refused, and on the CPU the server has a refusal must
cost far less than an answer (issue 46). A call the Python listener takes costs it 50-270 us
even when refused, and competes with the answered ones for the event loop: with a load
generator that keeps its schedule, the aio listener answered 0.61-0.85x of its capacity at 4x
offered and 0.34-0.49x at 8x (benchmarks/notes/2026-12-05-native-front.md).

How: ``genrec serve`` starts ``cpp/front.cc`` as its child on the public host and port; the
server listens behind it on two Unix sockets in a private (0700) folder, which nobody but the
front end and its user reaches: the Recommender calls it passes on arrive as frames on one
(serve.link: a second gRPC call per call had cost the Python server about half its CPU per
call), health checks and reflection on the other, the server's gRPC listener. The front end passes at most
``connections.max_in_flight`` Recommender calls to the server at once, and while another
caller is active at most ``fair.max_share`` of them to one heavy caller (named by
``fair.metadata_key``, else its peer host, as serve.admission names callers; heavy: it sent more
than ``fair.max_share`` of the recent calls; work-conserving, as its shares are).
Past either it answers RESOURCE_EXHAUSTED itself, without the server seeing the call; a call
past the cap alone first waits up to ``connections.max_wait_ms`` for a place while the front
end is not overloaded (a healthy load's burst is served late, not refused; under a flood calls
past the cap are refused at once, except a light caller's, which take the places that free). The cap
is the server's admission moved in front of it: sized near what the server answers within its
queueing budget (``batch.max_queue_ms`` / one call's cost), the server's own admission rarely
refuses, so Python runs almost only for calls it answers. The caller's name travels on as
metadata (the server's quotas see the same callers), and so does the front end's judgement of
it beside others (``serve.admission.CONTENTION_KEY``: heavy or light), which the server's
batcher holds the call to instead of judging again from the calls let through; so do deadlines
and cancellations. Health checks and reflection pass uncapped.

Built on first use against the system's gRPC C++ library (:mod:`genrec.native_build`; Debian:
``apt-get install libgrpc++-dev``). TLS on the public port is not terminated here yet: a config
with both is refused.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from genrec.native_build import NativeBuildError, build_program, unavailable

SOURCE = Path(__file__).parent / "cpp" / "front.cc"


class FrontError(RuntimeError):
    """The front end cannot be built here, or did not start listening."""


@dataclass(frozen=True)
class FrontPlan:
    """What the front end is told: where it listens, where the server is, its caps."""

    host: str
    port: int  # 0: any free port (reported once it listens)
    upstream: str  # the gRPC server's address (health, reflection): unix:PATH (its private socket) or host:port
    link: str  # the Unix socket (a path) of the server's link for Recommender calls (serve.link)
    max_in_flight: int  # Recommender calls passed to the server at once
    max_share: float  # one caller's share of them while another is active (0: no per-caller cap)
    active_s: float  # a caller counts as active this long after its last call
    metadata_key: str  # the callers' name key
    max_message_bytes: int  # the largest request the server's limits allow
    max_wait_ms: float  # how long a call past the cap may wait for a place (0: refused at once)
    nice: int  # nice levels below the server's priority (0-19), set by itself before any thread starts

    def argv(self) -> list[str]:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return [f"{host}:{self.port}", self.upstream, str(self.max_in_flight),
                f"{self.max_share:g}", f"{self.active_s:g}", self.metadata_key, str(self.max_message_bytes),
                f"{self.max_wait_ms:g}", self.link, str(self.nice)]


@functools.cache
def _built() -> Path:
    return build_program(SOURCE)


def binary() -> Path:
    """The built front end (built now if this source, compiler and library have none yet)."""
    try:
        return _built()
    except NativeBuildError as e:
        raise FrontError(f"serve.connections.front_end = 'native': {e}") from None


def available() -> str | None:
    """None where the front end builds, else why not."""
    return unavailable(_built)


class NativeFront:
    """The front-end process for a :class:`FrontPlan`; :meth:`stop` ends it gracefully."""

    def __init__(self, plan: FrontPlan) -> None:
        self.plan, self.port = plan, 0
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> int:
        """Start it (building it first if needed) and wait until it listens; its port."""
        proc = self.proc = subprocess.Popen([str(binary()), *self.plan.argv()], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, text=True)  # (its errors: on the server's stderr)
        out = proc.stdout
        assert out is not None
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(out.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0].startswith("listening "):
            self.stop(0)
            raise FrontError(f"the front end did not listen on {self.plan.host}:{self.plan.port} in {timeout_s:g} s "
                             f"(exit status {proc.returncode}; its error above)")
        self.port = int(line[0].split()[1])
        return self.port

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """It stops taking calls and lets those it passed on finish (up to its own 10 s, or
        ``grace_s`` here), then exits; killed past it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s + 1)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
