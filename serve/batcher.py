"""Cross-request dynamic batching with a bounded queue, deadlines and load shedding.

Handlers ``await batcher.submit(work)``. One loop takes work off the queue: it waits for
the first item, then up to ``max_wait_ms`` (or until ``max_batch`` items) for more, drops
items whose deadline has passed (they fail with DEADLINE_EXCEEDED without costing model
time), and runs the batch on the engine in a worker thread (an engine process: over its
pipe from the loop) so the event loop keeps accepting calls. ``max_inflight`` batches may be
in flight at once: for one engine process, they pipeline (the next waits in the pipe while
one computes, so the engine never idles while the front-end collects results and sends more);
for replicas, one each; in-process, they share the CPU (torch releases the GIL).

A full queue fails the new item at once with ``Overloaded`` (RESOURCE_EXHAUSTED): past
capacity the server sheds load instead of queueing it, so latency and memory stay bounded.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from serve.engine import Result, run_stamped
from serve.requests import Work


class Overloaded(RuntimeError):
    """The queue is full."""


class DeadlineExceeded(RuntimeError):
    """The caller's deadline passed before the work ran."""


class ShuttingDown(RuntimeError):
    """The server is draining and takes no new work."""


@dataclass(frozen=True)
class BatchConfig:
    max_batch: int = 32
    max_wait_ms: float = 2.0
    max_queue: int = 256
    max_inflight: int = 1


class Batcher:
    def __init__(self, engine_fn: Callable[[], object], cfg: BatchConfig,
                 on_batch: Callable[[int, int], None] | None = None) -> None:
        """``engine_fn`` returns the current engine (read per batch, so a reload swaps it
        between batches); ``on_batch(batch_size, queue_depth)`` feeds metrics."""
        self.engine_fn, self.cfg, self.on_batch = engine_fn, cfg, on_batch
        self.queue: collections.deque[tuple[Work, asyncio.Future]] = collections.deque()
        self.wakeup = asyncio.Event()
        self.pool = ThreadPoolExecutor(max_workers=cfg.max_inflight, thread_name_prefix="engine")
        self.slots = asyncio.Semaphore(cfg.max_inflight)
        self.closing = False
        self.running: set[asyncio.Task] = set()
        self.loop_task: asyncio.Task | None = None

    def start(self) -> None:
        self.loop_task = asyncio.get_running_loop().create_task(self._loop())

    @property
    def depth(self) -> int:
        return len(self.queue)

    async def submit(self, work: Work, timeout: float | None = None) -> Result:
        """The work's result; ``timeout`` (s): TimeoutError after it, and the work is dropped
        unrun if it is still queued (its future cancelled). The future is awaited directly, so
        a call costs no task of its own."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        if len(self.queue) >= self.cfg.max_queue:
            raise Overloaded(f"queue full ({self.cfg.max_queue} requests waiting); retry with backoff")
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((work, fut))
        self.wakeup.set()
        return await (fut if timeout is None else asyncio.wait_for(fut, timeout))

    async def _collect(self) -> list[tuple[Work, asyncio.Future]]:
        while not self.queue:
            self.wakeup.clear()
            await self.wakeup.wait()
        end = time.monotonic() + self.cfg.max_wait_ms / 1e3
        while len(self.queue) < self.cfg.max_batch and time.monotonic() < end:
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), timeout=max(end - time.monotonic(), 0))
            except TimeoutError:
                break
        batch, now = [], time.monotonic()
        while self.queue and len(batch) < self.cfg.max_batch:
            work, fut = self.queue.popleft()
            if fut.done():  # the caller went away
                continue
            if work.deadline <= now:
                fut.set_exception(DeadlineExceeded("deadline passed while queued"))
                continue
            batch.append((work, fut))
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.slots.acquire()
            batch = await self._collect()
            if not batch:
                self.slots.release()
                continue
            if self.on_batch:
                self.on_batch(len(batch), len(self.queue))
            task = loop.create_task(self._run(batch))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run(self, batch: list[tuple[Work, asyncio.Future]]) -> None:
        try:
            engine = self.engine_fn()
            works = [w for w, _ in batch]
            sent = time.monotonic()
            if hasattr(engine, "run_async"):  # an engine process: the pipe is awaited on the loop
                results = await engine.run_async(works)
            else:  # an in-process engine computes in the executor thread (it drops the GIL in its kernels)
                results = await asyncio.get_running_loop().run_in_executor(self.pool, run_stamped, engine, works)
            back = time.monotonic()
            for (_, fut), res in zip(batch, results):
                res.sent, res.back = sent, back
                if not fut.done():
                    fut.set_result(res)
        except Exception as e:  # noqa: BLE001 - every caller of the batch gets the error
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
        finally:
            self.slots.release()

    async def drain(self, timeout: float) -> None:
        """Stops taking work, lets queued and running batches finish (up to ``timeout``)."""
        self.closing = True
        end = time.monotonic() + timeout
        while (self.queue or self.running) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if self.loop_task:
            self.loop_task.cancel()
        for _, fut in self.queue:
            if not fut.done():
                fut.set_exception(ShuttingDown("the server shut down before this request ran"))
        self.pool.shutdown(wait=False)
