"""Cross-request dynamic batching with a bounded queue, deadlines and load shedding.

Handlers ``await batcher.submit(work)``. One loop takes work off the queue: it waits for
the first item, then up to ``max_wait_ms`` (or until ``max_batch`` items) for more, drops
items whose deadline has passed (they fail with DEADLINE_EXCEEDED without costing model
time), and runs the batch with the engine's ``run_async`` (serve.contract.Engine: an engine
process over its pipe from the loop, an in-process engine in a worker thread) so the event
loop keeps accepting calls. ``max_inflight`` batches may be
in flight at once: for one engine process, they pipeline (the next waits in the pipe while
one computes, so the engine never idles while the front-end collects results and sends more);
for replicas, one each; in-process, they share the CPU (torch releases the GIL).

Admission (``admit``, before a call is even decoded): a call that could not start within
``max_queue_ms``, or before its own deadline, is refused at once with ``Overloaded``
(RESOURCE_EXHAUSTED). The wait is predicted from the work ahead of it (queued calls and
batches in flight) and a cost model of the engine's batches, ``seconds = a + c x size``,
fitted online to the batches it ran (:class:`BatchCost`). Past capacity the queue then holds
about ``max_queue_ms`` of work: admitted calls keep their latency, refused ones learn it in
microseconds and can go elsewhere, and the engine stays busy with calls that will be served
in time instead of ones whose callers gave up (goodput stays near capacity). A full queue
(``max_queue``, a memory bound) refuses as well.

Fair queueing: each caller (``submit(..., caller=)``: a tenant, serve.admission) has its own
queue, and a batch takes calls from the callers' queues in turn (round robin), so a caller
that floods the server waits behind its own backlog, not others behind it; admission predicts
each call's wait from the calls that will run before it under that order.

Each call runs on the engine it was validated for (``submit(work, engine=...)``; default: the
engine of the moment), whatever was swapped in since: a batch holds the calls of one engine,
and :meth:`Batcher.retire` says when a replaced engine has none left to run, so that it can
close. (A call decoded against the old model's schema, run on the new one, failed its whole
batch with INTERNAL; re-validating it instead would need the request's bytes kept and could
refuse a call that was valid when it arrived. Keeping the old engine up to one deadline
longer costs nothing new: it is loaded until the swap anyway.)
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from genrec.serve.contract import Engine, Result
from genrec.serve.requests import Work


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
    # batches in flight at once; 0: the server chooses for its engine (serve.server.batch_inflight:
    # three pipelined through one engine process, one per replica, one in-process), and a Batcher
    # built on its own runs one at a time
    max_inflight: int = 0
    # refuse a call predicted to wait longer than this for its batch to start (0: no limit but
    # the caller's deadline and max_queue); a fraction of the latency budget callers hold us to
    max_queue_ms: float = 20.0


class BatchCost:
    """Engine seconds of a batch of ``b`` calls, ``a + c x b``, by least squares over the last
    ``window`` batches (the model follows the machine), refitted without the batches that cost
    more than ``outlier`` times what the fit predicts for them where those are few (at most an
    eighth of the window). Until the sizes vary (or when the fit makes no sense), the mean
    batch with no per-call part: small batches cost about the same whatever their size, and
    charging a lone call's whole cost to every call ahead refused calls at half the capacity (a
    fresh server, batches of 1-3 calls).

    Why a window and the trim: a user's first call with a long history encodes it whole (an
    8,000-event history: 0.3-2 s) where its later calls extend a cached one (10-20 ms). An
    exponential mean carried a burst of such cold batches (a fresh cache) for about a hundred
    batches after it, predicting waits of hundreds of ms behind every warm call, and refused
    them. Now the burst is gone from the fit a window later (sooner: once it is an eighth of
    the window), and a rare cold batch among warm ones does not move it. Calls of different
    costs mixed (a fifth of them 10x the rest) stay in the fit: only rare extremes leave it.
    (Behind a cold batch in flight, admission then predicts less wait than there is: the
    caller's deadline still bounds it, serve.server.)"""

    def __init__(self, window: int = 32, outlier: float = 8.0) -> None:
        self.obs: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.outlier, self.rare = outlier, max(window // 8, 1)
        self.fit: tuple[float, float] | None = None

    def observe(self, size: int, seconds: float) -> None:
        self.obs.append((size, seconds))
        self.fit = self._fit(list(self.obs))
        if len(self.obs) > 2:  # the fit again without a few batches far above it (cold ones)
            a, c = self.fit
            ratio = sorted(t / max(a + c * b, 1e-9) for b, t in self.obs)[len(self.obs) // 2]
            kept = [(b, t) for b, t in self.obs if t <= self.outlier * ratio * (a + c * b)]
            if 0 < len(self.obs) - len(kept) <= self.rare:
                self.fit = self._fit(kept)

    @staticmethod
    def _fit(obs: list[tuple[int, float]]) -> tuple[float, float]:
        n = len(obs)
        sb = sum(b for b, _ in obs)
        st = sum(t for _, t in obs)
        var = n * sum(b * b for b, _ in obs) - sb * sb
        if var > 1e-6 * n * sum(b * b for b, _ in obs):
            c = (n * sum(b * t for b, t in obs) - sb * st) / var
            a = (st - c * sb) / n
            if a >= 0 and c >= 0:
                return a, c
        return st / n, 0.0  # one size seen (or a fit that makes no sense): per batch

    def coefficients(self) -> tuple[float, float] | None:
        """(a, c), or None before the first batch."""
        return self.fit

    def wait(self, batches: float, calls: float) -> float:
        ac = self.coefficients()
        return 0.0 if ac is None else ac[0] * batches + ac[1] * calls


def _batch_seconds(results: list[Result]) -> float:
    """Engine time of a batch: a batching engine stamps every result with the batch's time, a
    one-at-a-time engine each with its own."""
    if results[0].batch_size == len(results) > 1:
        return results[0].compute_ms / 1e3
    return sum(r.compute_ms for r in results) / 1e3


class Batcher:
    def __init__(self, engine_fn: Callable[[], Engine], cfg: BatchConfig,
                 on_batch: Callable[[int, int], None] | None = None) -> None:
        """``engine_fn`` returns the current engine (read per batch, so a reload swaps it
        between batches); ``on_batch(batch_size, queue_depth)`` feeds metrics."""
        self.engine_fn, self.cfg, self.on_batch = engine_fn, cfg, on_batch
        # per caller, in arrival order of the callers' first queued call (round robin from the front)
        self.queues: dict[str, collections.deque[tuple[Work, asyncio.Future, Engine]]] = {}
        self.queued = 0
        self.wakeup = asyncio.Event()
        self.inflight = max(cfg.max_inflight, 1)
        self.slots = asyncio.Semaphore(self.inflight)
        self.closing = False
        self.running: set[asyncio.Task] = set()
        self.loop_task: asyncio.Task | None = None
        self.cost = BatchCost()
        self.inflight_calls = 0  # calls in batches handed to the engine and not yet back
        self.engines_running: list[Engine] = []  # the engine of each batch in flight

    def start(self) -> None:
        self.loop_task = asyncio.get_running_loop().create_task(self._loop())

    @property
    def depth(self) -> int:
        return self.queued

    def ahead(self, caller: str = "") -> int:
        """Queued calls that would run before a call ``caller`` sends now: under round robin, up to
        one more than its own queue's length from each other caller, and its whole own queue."""
        mine = len(self.queues.get(caller, ()))
        if len(self.queues) <= 1 or self.queued <= mine + 1:
            return self.queued
        return sum(min(len(q), mine + 1) if c != caller else mine for c, q in self.queues.items())

    def predicted_wait(self, cost: tuple[float, float] | None = None, caller: str = "") -> float:
        """Seconds until a call ``caller`` sends now would start: the batches in flight, then the
        queued calls ahead of it (:meth:`ahead`, in batches of up to ``max_batch``), at the fitted
        cost ``(a, c)`` (default: the current fit), spread over the engines that run batches side by side."""
        a, c = cost or self.cost.coefficients() or (0.0, 0.0)
        queued = self.ahead(caller)
        batches = len(self.running) + -(-queued // self.cfg.max_batch)
        return (a * batches + c * (self.inflight_calls + queued)) / self.parallel

    @property
    def parallel(self) -> int:
        """Batches the engine computes side by side: one per replica, or every batch in flight
        for an engine that merges them (``batches_together``: SGLang's continuous batching)."""
        engine = self.engine_fn()
        return self.inflight if engine.batches_together else max(engine.parallel, 1)

    def admit(self, deadline: float, caller: str = "") -> None:
        """Raises ``Overloaded`` (or ``ShuttingDown``) at once for a call that would not start in
        time; cheap enough to run before a request is decoded."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        if self.queued >= self.cfg.max_queue:
            raise Overloaded(f"queue full ({self.cfg.max_queue} requests waiting); retry with backoff")
        a, c = self.cost.coefficients() or (0.0, 0.0)  # (fitted once per call: this runs on every call)
        wait = self.predicted_wait((a, c), caller)
        if self.cfg.max_queue_ms > 0 and wait * 1e3 > self.cfg.max_queue_ms:
            raise Overloaded(f"overloaded: a call would wait ~{wait * 1e3:.0f} ms to start, more than the "
                             f"server's {self.cfg.max_queue_ms:g} ms; retry with backoff or another replica")
        # (+ its own batch). An idle server always tries: a refusal teaches the cost model nothing,
        # so one slow batch (a cold prefill) would otherwise refuse every later call for good
        idle = not self.running and not self.queued
        if not idle and time.monotonic() + wait + a + c > deadline:
            raise Overloaded(f"overloaded: a call would wait ~{wait * 1e3:.0f} ms to start and could not finish "
                             "before its deadline; retry with backoff or another replica")

    async def submit(self, work: Work, timeout: float | None = None, caller: str = "",
                     engine: Engine | None = None) -> Result:
        """The work's result, computed by ``engine``: the one it was validated for (default:
        the current one); ``timeout`` (s): TimeoutError after it, and the work is dropped
        unrun if it is still queued (its future cancelled). ``caller``: whose queue it joins (fair
        queueing). The future is awaited directly, so a call costs no task of its own."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        if self.queued >= self.cfg.max_queue:
            raise Overloaded(f"queue full ({self.cfg.max_queue} requests waiting); retry with backoff")
        fut = asyncio.get_running_loop().create_future()
        self._queue(caller).append((work, fut, engine if engine is not None else self.engine_fn()))
        self.queued += 1
        self.wakeup.set()
        return await (fut if timeout is None else asyncio.wait_for(fut, timeout))

    def uses(self, engine: Engine) -> bool:
        """Whether a call queued (and still awaited) or a batch in flight is ``engine``'s."""
        return (any(e is engine for e in self.engines_running)
                or any(e is engine and not fut.done() for q in self.queues.values() for _, fut, e in q))

    async def retire(self, engine: Engine, timeout: float) -> None:
        """Returns once no call for ``engine`` (replaced by a reload) is queued or in flight, or
        after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while self.uses(engine) and time.monotonic() < end:
            await asyncio.sleep(0.01)

    def _queue(self, caller: str) -> collections.deque[tuple[Work, asyncio.Future, Engine]]:
        """``caller``'s queue, made (last in turn) if it has none."""
        q = self.queues.get(caller)
        if q is None:
            q = self.queues[caller] = collections.deque()
        return q

    def _take(self) -> tuple[str, tuple[Work, asyncio.Future, Engine]]:
        """The next call in round-robin order, and its caller: the front caller's oldest; that
        caller then moves to the back (or leaves, its queue empty)."""
        caller = next(iter(self.queues))
        q = self.queues.pop(caller)
        item = q.popleft()
        if q:
            self.queues[caller] = q  # (re-inserted: now last in turn)
        self.queued -= 1
        return caller, item

    async def _collect(self) -> tuple[list[tuple[Work, asyncio.Future]], Engine | None]:
        while not self.queued:
            self.wakeup.clear()
            await self.wakeup.wait()
        end = time.monotonic() + self.cfg.max_wait_ms / 1e3
        while self.queued < self.cfg.max_batch and time.monotonic() < end:
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), timeout=max(end - time.monotonic(), 0))
            except TimeoutError:
                break
        batch: list[tuple[Work, asyncio.Future]] = []
        engine: Engine | None = None  # the batch's: its first call's
        other: list[tuple[str, tuple[Work, asyncio.Future, Engine]]] = []  # calls for another engine (a swap)
        now = time.monotonic()
        while self.queued and len(batch) < self.cfg.max_batch:
            caller, item = self._take()
            work, fut, e = item
            if fut.done():  # the caller went away
                continue
            if work.deadline <= now:
                fut.set_exception(DeadlineExceeded("deadline passed while queued"))
                continue
            if engine is None:
                engine = e
            if e is not engine:
                other.append((caller, item))
                continue
            batch.append((work, fut))
        for caller, item in reversed(other):  # back at the front of their callers' queues, in order
            self._queue(caller).appendleft(item)
            self.queued += 1
        return batch, engine

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.slots.acquire()
            batch, engine = await self._collect()
            if not batch or engine is None:
                self.slots.release()
                continue
            if self.on_batch:
                self.on_batch(len(batch), self.queued)
            self.engines_running.append(engine)
            task = loop.create_task(self._run(batch, engine))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run(self, batch: list[tuple[Work, asyncio.Future]], engine: Engine) -> None:
        self.inflight_calls += len(batch)
        try:
            works = [w for w, _ in batch]
            sent = time.monotonic()
            results = await engine.run_async(works)
            back = time.monotonic()
            if results:
                self.cost.observe(len(results), _batch_seconds(results))
            for (_, fut), res in zip(batch, results):
                res.sent, res.back = sent, back
                if not fut.done():
                    fut.set_result(res)
        except Exception as e:  # noqa: BLE001 - every caller of the batch gets the error
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
        finally:
            self.inflight_calls -= len(batch)
            self.engines_running.remove(engine)
            self.slots.release()

    async def drain(self, timeout: float) -> None:
        """Stops taking work, lets queued and running batches finish (up to ``timeout``)."""
        self.closing = True
        end = time.monotonic() + timeout
        while (self.queued or self.running) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if self.loop_task:
            self.loop_task.cancel()
        for _, fut, _ in (item for q in self.queues.values() for item in q):
            if not fut.done():
                fut.set_exception(ShuttingDown("the server shut down before this request ran"))
