"""serve.link: the frames between the native front end and the server, on the Python side."""

from __future__ import annotations

import asyncio
import struct
import time

import grpc

from genrec.serve.link import CALL, CANCEL, Link, parse_call, reply_frame

KINDS = {"/genrec.v1.Recommender/Retrieve": "retrieve"}


def call_frame(call_id: int, method: str, metadata: list[tuple[str, str]], data: bytes, deadline_us: int = -1) -> bytes:
    """A call frame as serve/cpp/front.cc writes it."""
    body = struct.pack("<BQqH", CALL, call_id, deadline_us, len(method)) + method.encode()
    body += struct.pack("<H", len(metadata))
    for k, v in metadata:
        body += struct.pack("<H", len(k)) + k.encode() + struct.pack("<I", len(v)) + v.encode()
    body += data
    return struct.pack("<I", len(body)) + body


def replies(raw: bytes) -> list[tuple[int, int, str, bytes]]:
    """(call id, status code, message, payload) of each reply frame in ``raw``."""
    out, at = [], 0
    while at < len(raw):
        size, call_id, code, n = struct.unpack_from("<IQBI", raw, at)
        rest = raw[at + 17:at + 4 + size]
        out.append((call_id, code, rest[:n].decode(), bytes(rest[n:])))
        at += 4 + size
    return out


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out, self.closed = bytearray(), False

    def write(self, data) -> None:  # noqa: ANN001
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_a_call_frame_round_trips_with_its_deadline_metadata_and_bytes():
    at = int((time.monotonic() + 0.25) * 1e6)  # the deadline: an instant of CLOCK_MONOTONIC
    frame = call_frame(7, "/genrec.v1.Recommender/Retrieve", [("tenant", "ads"), ("genrec-contention", "light")],
                       b"\x00\x01request", deadline_us=at)
    time.sleep(0.05)  # (a frame read later keeps its instant: the wait was spent)
    deadline, method, metadata, data = parse_call(memoryview(frame)[4 + 9:])
    assert method == "/genrec.v1.Recommender/Retrieve" and data == b"\x00\x01request"
    assert metadata == (("tenant", "ads"), ("genrec-contention", "light"))
    assert deadline == at / 1e6
    assert parse_call(memoryview(call_frame(1, "m", [], b""))[4 + 9:])[0] is None  # no deadline
    ok = reply_frame(3, grpc.StatusCode.OK, b"answer")
    refused = reply_frame(4, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")
    assert replies(ok + refused) == [(3, 0, "", b"answer"), (4, 8, "overloaded", b"")]


def test_frames_split_anywhere_are_served_in_order_and_a_cancel_ends_its_call():
    """Frames arrive in pieces of any size; each call runs as a task of its own and is answered
    once; a cancel frame cancels its task, which is answered CANCELLED; a method the link does
    not serve is UNIMPLEMENTED."""
    seen, release = [], asyncio.Event()

    async def outcome(kind: str, data: bytes, context) -> tuple[grpc.StatusCode, bytes]:  # noqa: ANN001
        seen.append((kind, data, context.invocation_metadata(), context.peer()))
        if data == b"hold":
            await release.wait()
        return grpc.StatusCode.OK, data.upper()

    async def main() -> bytes:
        link, transport = Link(outcome, KINDS), Transport()
        link.connection_made(transport)
        m = "/genrec.v1.Recommender/Retrieve"
        stream = (call_frame(1, m, [("tenant", "a")], b"one") + call_frame(2, m, [], b"hold")
                  + call_frame(3, "/genrec.v1.Recommender/Nope", [], b"") + call_frame(4, m, [], b"hold"))
        for i in range(0, len(stream), 5):  # 5 bytes at a time
            link.data_received(stream[i:i + 5])
        for _ in range(3):
            await asyncio.sleep(0)
        link.data_received(struct.pack("<IBQ", 9, CANCEL, 4))
        await asyncio.sleep(0)
        release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not link.calls
        return bytes(transport.out)

    got = {r[0]: r[1:] for r in replies(asyncio.run(main()))}
    assert got == {1: (0, "", b"ONE"), 2: (0, "", b"HOLD"), 3: (12, "method /genrec.v1.Recommender/Nope is not "
                                                                   "served over the link", b""),
                   4: (1, "the call was cancelled", b"")}
    assert seen[0] == ("retrieve", b"one", (("tenant", "a"),), "unix:front-end")


def test_a_frame_of_impossible_size_closes_the_link():
    link, transport = Link(lambda *a: None, KINDS), Transport()  # type: ignore[arg-type,return-value]
    link.connection_made(transport)
    link.data_received(struct.pack("<I", 3) + b"abc")
    assert transport.closed


def test_a_call_cancelled_in_the_same_read_is_answered_and_forgotten_and_a_failing_call_is_answered():
    """A call and its cancel read together: the task was cancelled before its first step, so
    its own clean-up never ran and the server kept every such task for good (the review of
    2026-12-07 sent 1,000 pairs: 1,000 tasks left). And a call whose outcome raised got no reply:
    the front end held its place for ever."""

    async def outcome(kind: str, data: bytes, context) -> tuple[grpc.StatusCode, bytes]:  # noqa: ANN001
        if data == b"boom":
            raise KeyError("a bug")
        return grpc.StatusCode.OK, data

    async def main() -> tuple[Link, bytes]:
        link, transport = Link(outcome, KINDS), Transport()
        link.connection_made(transport)
        m = "/genrec.v1.Recommender/Retrieve"
        chunk = b"".join(call_frame(i, m, [], b"x") + struct.pack("<IBQ", 9, CANCEL, i) for i in range(1, 101))
        link.data_received(chunk + call_frame(500, m, [], b"boom"))
        for _ in range(5):
            await asyncio.sleep(0)
        return link, bytes(transport.out)

    link, raw = asyncio.run(main())
    got = {r[0]: r[1:] for r in replies(raw)}
    assert not link.calls
    # (a call cancelled before it started may go unanswered: the front end answered it CANCELLED
    # when it sent the cancel, and drops a later reply)
    assert all(got.get(i, (grpc.StatusCode.CANCELLED.value[0],))[0] == grpc.StatusCode.CANCELLED.value[0]
               for i in range(1, 101))
    assert got[500] == (grpc.StatusCode.INTERNAL.value[0], "internal error: KeyError", b"")


def test_a_front_end_stopped_with_a_call_the_server_never_answers_exits_cleanly(tmp_path):
    """SIGTERM gives calls passed on 10 s; past it gRPC cancels them, and their done notices came
    after the completion queue's shutdown: answering them there aborted the process (exit -6,
    found by the review of 2026-12-07, older than the link). Once the queue shuts down nothing
    starts on it, and the front end exits 0."""
    import os
    import signal
    import subprocess
    import threading

    from genrec.serve.link import serve_link
    from genrec.serve.proxy import FrontPlan, available, binary
    from tests.conftest import native_or_skip

    native_or_skip(available())
    link, ready, stop = str(tmp_path / "calls.sock"), threading.Event(), threading.Event()

    async def never(kind: str, data: bytes, context) -> tuple[grpc.StatusCode, bytes]:  # noqa: ANN001
        await asyncio.Event().wait()
        raise AssertionError("not reached")

    async def fake_server() -> None:
        listener = await serve_link(link, never, KINDS)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        listener.drop()

    server = threading.Thread(target=lambda: asyncio.run(fake_server()), daemon=True)
    server.start()
    assert ready.wait(10)
    plan = FrontPlan(host="127.0.0.1", port=0, upstream=f"unix:{tmp_path}/none.sock", link=link, max_in_flight=8,
                     max_share=0.0, active_s=1.0, metadata_key="tenant", max_message_bytes=1 << 20, max_wait_ms=0,
                     nice=0)
    proc = subprocess.Popen([str(binary()), *plan.argv()], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split()[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            held = ch.unary_unary("/genrec.v1.Recommender/Retrieve").future(b"", timeout=60)
            time.sleep(0.3)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            assert 9 < time.monotonic() - t0 < 20
            assert held.exception(timeout=5) is not None  # (cancelled at the front end's shutdown)
    finally:
        stop.set()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        server.join(5)
