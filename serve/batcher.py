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
each call's wait from the calls that will run before it under that order. The batches in
flight are everyone's wait, whatever the order: while another caller is active, a caller
holding more than its share of the calls is refused once the work ahead passes its share of
``max_queue_ms`` (``admit(..., share=)``), so a flood cannot keep the pipeline full of its own
calls and the others' calls still start within the budget.

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

from genrec.serve.contract import Engine, PartlyFailed, Result
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
    """Engine seconds of a batch of ``b`` calls, ``a + c x b``, by least squares over recent
    batches (exponentially weighted: the model follows the machine). Until the sizes vary (or
    when the fit makes no sense), the mean batch with no per-call part: small batches cost
    about the same whatever their size, and charging a lone call's whole cost to every call
    ahead refused calls at half the capacity (a fresh server, batches of 1-3 calls).

    Two guards keep cold batches out of it. A user's first call with a long history encodes it
    whole (an 8,000-event history: 0.2-2 s) where its later calls extend a cached one (10-20
    ms): a batch ``outlier`` times above the fit, while such batches are rare (at most an
    eighth of the last ``window``), is left out; and where the fit is ``outlier`` times off the
    median batch of the last ``window`` (a burst of cold batches, a fresh cache, then warm
    ones), it is fitted again from those recent batches near their median. The exponential mean
    alone carried such a burst for about a hundred batches and refused warm calls meanwhile.
    (Behind a cold batch in flight, admission then predicts less wait than there is: the
    caller's deadline still bounds it, serve.server.)"""

    def __init__(self, decay: float = 0.02, window: int = 32, outlier: float = 8.0) -> None:
        self.decay, self.outlier, self.rare = decay, outlier, max(window // 8, 1)
        self.recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.n = self.sb = self.st = self.sbb = self.sbt = 0.0

    def observe(self, size: int, seconds: float) -> None:
        self.recent.append((size, seconds))
        ac = self.coefficients()
        if ac is not None and len(self.recent) * 2 >= (self.recent.maxlen or 1):
            ratios = [t / max(ac[0] + ac[1] * b, 1e-9) for b, t in self.recent]
            mid = sorted(ratios)[len(ratios) // 2]
            if not 1 / self.outlier <= mid <= self.outlier:  # the fit no longer describes a typical batch
                self.n = self.sb = self.st = self.sbb = self.sbt = 0.0
                for (b, t), r in zip(self.recent, ratios):
                    if mid / self.outlier <= r <= mid * self.outlier:
                        self._add(b, t)
                return
            if ratios[-1] > self.outlier and sum(r > self.outlier for r in ratios) <= self.rare:
                return  # a rare cold batch: not what the next one will cost
        self._add(size, seconds)

    def _add(self, size: int, seconds: float) -> None:
        k = 1.0 - self.decay
        self.n, self.sb, self.st = k * self.n + 1, k * self.sb + size, k * self.st + seconds
        self.sbb, self.sbt = k * self.sbb + size * size, k * self.sbt + size * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, c), or None before the first batch."""
        if self.n == 0:
            return None
        var = self.n * self.sbb - self.sb * self.sb
        if var > 1e-6 * self.n * self.sbb:
            c = (self.n * self.sbt - self.sb * self.st) / var
            a = (self.st - c * self.sb) / self.n
            if a >= 0 and c >= 0:
                return a, c
        return self.st / self.n, 0.0  # one size seen (or a fit that makes no sense): per batch

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
        self.held: dict[str, int] = {}  # each caller's calls submitted and not yet answered
        self.held_total = 0
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

    def admit(self, deadline: float, caller: str = "", share: float | None = None) -> None:
        """Raises ``Overloaded`` (or ``ShuttingDown``) at once for a call that would not start in
        time; cheap enough to run before a request is decoded. ``share`` (serve.admission: the fair
        share, given while another caller is active): once the work ahead passes that fraction of
        ``max_queue_ms``, a caller holding more than that fraction of the calls in the server is
        refused, so one caller's backlog (in the queue and in the batches in flight) never fills
        the queueing budget that the others' calls need to start in time. ``share = 0``: a light
        caller beside a heavy one, whose wait is mostly the heavy caller's calls in flight: it
        may wait up to twice ``max_queue_ms``."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        if self.queued >= self.cfg.max_queue:
            raise Overloaded(f"queue full ({self.cfg.max_queue} requests waiting); retry with backoff")
        a, c = self.cost.coefficients() or (0.0, 0.0)  # (fitted once per call: this runs on every call)
        wait = self.predicted_wait((a, c), caller)
        if share and self.cfg.max_queue_ms > 0 and wait * 1e3 > share * self.cfg.max_queue_ms:
            mine = self.held.get(caller, 0)
            if mine > share * self.held_total:
                raise Overloaded(f"caller {caller!r} holds {mine} of the {self.held_total} calls in the server, more "
                                 f"than its share ({share:g}), while other callers wait; retry with backoff")
        budget_ms = self.cfg.max_queue_ms * (2 if share == 0.0 else 1)
        if self.cfg.max_queue_ms > 0 and wait * 1e3 > budget_ms:
            raise Overloaded(f"overloaded: a call would wait ~{wait * 1e3:.0f} ms to start, more than the "
                             f"server's {budget_ms:g} ms; retry with backoff or another replica")
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
        self.held[caller] = self.held.get(caller, 0) + 1
        self.held_total += 1
        self.wakeup.set()
        try:
            return await (fut if timeout is None else asyncio.wait_for(fut, timeout))
        finally:  # answered, failed, expired or cancelled: no longer the caller's (a batch may still run it)
            self.held_total -= 1
            left = self.held[caller] - 1
            if left:
                self.held[caller] = left
            else:
                del self.held[caller]  # (callers come and go: only those with calls in the server)

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
            try:
                outcomes: list = await engine.run_async(works)
                if outcomes:
                    self.cost.observe(len(outcomes), _batch_seconds(outcomes))
            except PartlyFailed as e:  # each call gets its own answer or its own failure (not a cost sample)
                outcomes = e.outcomes
            back = time.monotonic()
            for (_, fut), out in zip(batch, outcomes):
                if fut.done():
                    continue
                if isinstance(out, Result):
                    out.sent, out.back = sent, back
                    fut.set_result(out)
                else:
                    fut.set_exception(out)
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
