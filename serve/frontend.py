"""The public listener on gRPC's thread-pool server (``serve.connections.front_end = "threads"``).
(The third kind, ``"native"``, a C++ front end before the aio listener: ``serve.proxy``.)

Why: under overload most calls must be refused, and on the CPU the server has, a refusal must
cost far less than an answer (issue 46). What one refused call costs the server's CPU
(benchmarks/notes/2026-12-05-refusal-cost.md): ``grpc.aio``, whose event loop accepts every call
and runs Python for it, 223-270 us; gRPC's thread-pool server past its
``maximum_concurrent_rpcs``, refused on its polling thread before any handler, ~53 us. An
answered call costs about the same on both (~220-270 us with the hop below).

How (``RecommenderServer._threaded``): the pool's handlers (one thread per handler slot) take
the caller's fair share (serve.admission; refused there, naming the caller, without the event
loop), then hand the call to the server's event loop, where the same coroutine as on the aio
listener admits, decodes, batches and encodes it, and block on its outcome (status, bytes or
message), answered or aborted on the handler's thread. ``maximum_concurrent_rpcs`` is the
pool's size: past it gRPC refuses on its polling thread, so a flood is shed at ~53 us a call.

The health servicer is the thread-pool one (``grpc_health.v1.health.HealthServicer``) behind
the two coroutines the server awaits on the aio one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import grpc
from grpc_health.v1 import health

FrontEnd = Literal["aio", "threads", "native"]  # (native: serve.proxy)


class ThreadListener:
    """The thread-pool gRPC server, with the few coroutines ``RecommenderServer`` awaits on a
    ``grpc.aio.Server`` (start, stop, wait_for_termination)."""

    def __init__(self, options: Sequence[tuple[str, Any]], slots: int, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pool = ThreadPoolExecutor(slots, thread_name_prefix="genrec-call")
        self.server = grpc.server(self.pool, options=list(options), maximum_concurrent_rpcs=slots)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers(tuple(handlers))

    def add_insecure_port(self, address: str) -> int:
        return self.server.add_insecure_port(address)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self.server.add_secure_port(address, credentials)

    async def start(self) -> None:
        self.server.start()

    async def stop(self, grace: float | None) -> None:
        done = self.server.stop(grace)
        await self.loop.run_in_executor(None, done.wait, (grace or 0) + 5)
        self.pool.shutdown(wait=False)

    async def wait_for_termination(self) -> None:
        await self.loop.run_in_executor(None, self.server.wait_for_termination)


class Health:
    """The thread-pool health servicer behind the aio one's coroutines (``set``,
    ``enter_graceful_shutdown``)."""

    def __init__(self) -> None:
        self.servicer = health.HealthServicer()

    async def set(self, service: str, status: int) -> None:
        self.servicer.set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        self.servicer.enter_graceful_shutdown()
