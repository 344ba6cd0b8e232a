"""The link between the native front end (``cpp/front.cc``) and the server behind it: the
Recommender calls the front end passes on, as frames on a Unix socket, instead of a second
gRPC call.

Why: behind the front end each answered call crossed two gRPC stacks (issue 46). A profile of
the server at 450 calls/s (benchmarks/notes/2026-12-07-front-link.md) put about half of its
Python process's CPU in ``grpc.aio``'s layers for that hop, on the one core the engine shares;
the front end paid for a client call of its own besides. A frame costs either side a read and a
write.

Frames (little-endian), front end to server::

    u32 size of the rest | u8 kind (1 call, 2 cancel) | u64 call id
    call:   i64 deadline, an instant of CLOCK_MONOTONIC in microseconds (-1: none)
            | u16 method size, method
            | u16 pairs, each u16 key size, key, u32 value size, value | the request's bytes

server to front end, one per call it runs (a call cancelled before it started gets none: the
front end answered it CANCELLED when it sent the cancel, and drops a later reply)::

    u32 size of the rest | u64 call id | u8 gRPC status code | u32 message size, message
    | the response's bytes (status OK)

The server runs each call as the aio listener would (``RecommenderServer._outcome``, with
:class:`LinkContext` for its servicer context). Health checks and reflection still reach the
server's gRPC listener on its own socket, beside this one in the same private folder.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from genrec.serve.requests import Kind

log = logging.getLogger(__name__)

CALL, CANCEL = 1, 2
_SIZE = struct.Struct("<I")
_HEAD = struct.Struct("<BQ")  # kind, call id
_CALL = struct.Struct("<qH")  # deadline (CLOCK_MONOTONIC us), method size
_U16, _U32 = struct.Struct("<H"), struct.Struct("<I")
_REPLY = struct.Struct("<IQBI")  # size of the rest, call id, status, message size
MAX_FRAME = 1 << 30

Outcome = Callable[[Kind, bytes, Any], Awaitable[tuple[grpc.StatusCode, Any]]]


class LinkContext:
    """What ``RecommenderServer._serve`` reads of a servicer context, for a call that came over
    the link: its deadline and its metadata (the front end's: the caller's name and its
    judgement of it, and whatever else the client sent)."""

    __slots__ = ("_deadline", "_metadata")

    def __init__(self, deadline: float | None, metadata: tuple[tuple[str, str], ...]) -> None:
        self._deadline, self._metadata = deadline, metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "unix:front-end"  # (the caller's name always comes as metadata over the link)


def parse_call(body: memoryview) -> tuple[float | None, str, tuple[tuple[str, str], ...], bytes]:
    """A call frame's body after its kind and id: (deadline on this clock or None, method,
    metadata, request bytes)."""
    deadline_us, n = _CALL.unpack_from(body, 0)
    at = _CALL.size
    method = bytes(body[at:at + n]).decode()
    at += n
    (pairs,) = _U16.unpack_from(body, at)
    at += 2
    metadata = []
    for _ in range(pairs):
        (kn,) = _U16.unpack_from(body, at)
        key = bytes(body[at + 2:at + 2 + kn]).decode(errors="replace")
        at += 2 + kn
        (vn,) = _U32.unpack_from(body, at)
        value = bytes(body[at + 4:at + 4 + vn]).decode(errors="replace")
        at += 4 + vn
        metadata.append((key, value))
    if at > len(body):
        raise ValueError("a call frame shorter than its fields")
    deadline = None if deadline_us < 0 else deadline_us / 1e6  # (time.monotonic is CLOCK_MONOTONIC)
    return deadline, method, tuple(metadata), bytes(body[at:])


def reply_frame(call_id: int, code: grpc.StatusCode, out: Any) -> bytes:
    """The reply to call ``call_id``: the response's bytes (OK) or a status and its message."""
    ok = code == grpc.StatusCode.OK
    message = b"" if ok else str(out).encode()
    payload = out if ok else b""
    return _REPLY.pack(_REPLY.size - 4 + len(message) + len(payload), call_id, code.value[0], len(message)) \
        + message + payload


class Link(asyncio.Protocol):
    """One connection from the front end: frames in, each call run by ``outcome(method, data,
    context)`` as a task of its own, its reply written when it is done; a cancel frame cancels
    the call's task (its client went away, or its deadline passed at the front end)."""

    def __init__(self, outcome: Outcome, kinds: Mapping[str, Kind], links: set[Link] | None = None) -> None:
        self.outcome, self.kinds, self.links = outcome, kinds, links
        self.buffer = bytearray()
        self.calls: dict[int, asyncio.Task] = {}
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.links is not None:
            self.links.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.links is not None:
            self.links.discard(self)
        for task in self.calls.values():  # nobody is left to answer
            task.cancel()
        self.calls.clear()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        at = 0
        while len(buf) - at >= 4:
            (size,) = _SIZE.unpack_from(buf, at)
            if size > MAX_FRAME or size < _HEAD.size:
                log.error("the front end's link sent a frame of %d bytes: closing it", size)
                if self.transport is not None:
                    self.transport.close()
                return
            if len(buf) - at - 4 < size:
                break
            body = memoryview(buf)[at + 4:at + 4 + size]
            try:
                self._frame(body)
            finally:
                body.release()
            at += 4 + size
        del buf[:at]

    def _frame(self, body: memoryview) -> None:
        kind, call_id = _HEAD.unpack_from(body, 0)
        if kind == CANCEL:  # (a call not yet started is answered CANCELLED all the same)
            task = self.calls.get(call_id)
            if task is not None:
                task.cancel()
            return
        try:
            deadline, method, metadata, data = parse_call(body[_HEAD.size:])
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            self._reply(call_id, grpc.StatusCode.INTERNAL, f"the front end's frame did not parse: {e}")
            return
        served = self.kinds.get(method)
        if served is None:
            self._reply(call_id, grpc.StatusCode.UNIMPLEMENTED, f"method {method} is not served over the link")
            return
        task = asyncio.get_running_loop().create_task(self._call(call_id, served, data, LinkContext(deadline, metadata)))
        self.calls[call_id] = task
        # (out of the table when done, however: a task cancelled before its first step never runs its body)
        task.add_done_callback(functools.partial(self._forget, call_id))

    def _forget(self, call_id: int, _task: asyncio.Task) -> None:
        self.calls.pop(call_id, None)

    async def _call(self, call_id: int, kind: Kind, data: bytes, context: LinkContext) -> None:
        try:
            code, out = await self.outcome(kind, data, context)
        except asyncio.CancelledError:
            code, out = grpc.StatusCode.CANCELLED, "the call was cancelled"
        except Exception as e:  # noqa: BLE001 - the front end waits for an answer to every call it sent
            log.exception("a call over the front end's link failed")
            code, out = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}"
        self._reply(call_id, code, out)

    def _reply(self, call_id: int, code: grpc.StatusCode, out: Any) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(reply_frame(call_id, code, out))


class LinkListener:
    """The server's end of the link: its Unix socket's listener and the connections it took."""

    def __init__(self) -> None:
        self.server: asyncio.AbstractServer | None = None
        self.links: set[Link] = set()

    def close(self) -> None:
        """No more connections; those open end with the front end (or :meth:`drop`)."""
        if self.server is not None:
            self.server.close()

    def drop(self) -> None:
        """Closes every connection too: the front end fails its calls out and stops."""
        self.close()
        for link in list(self.links):
            if link.transport is not None:
                link.transport.close()


async def serve_link(path: str, outcome: Outcome, kinds: Mapping[str, Kind]) -> LinkListener:
    """Listen for the front end on the Unix socket ``path`` (in the server's private folder)."""
    listener = LinkListener()
    listener.server = await asyncio.get_running_loop().create_unix_server(
        lambda: Link(outcome, kinds, listener.links), path)
    return listener
