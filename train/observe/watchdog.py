"""Hang and straggler diagnosis: which rank is in which collective when a step stalls.

Two pieces:

* ``COLLECTIVES``, this process's collective calls in progress. The calls genrec makes
  (``DistContext.reduce / barrier / broadcast``, the trainer's stop vote, the step-stats
  gather) enter it through ``collective(name)``; the DDP comm hook and the all-to-all timer
  ``train.loop.parallel`` installs enter it for DDP's gradient buckets and TorchRec's all-to-alls.
  Each entry gets this process's next sequence number, so ranks can be compared: every rank
  makes the same collectives in the same order, and a rank that has entered fewer (or has
  entered the same one without launching it) is behind the others. It is process-wide state
  because the collectives are: hooks run on the backend's threads and know no trainer.
* ``Watchdog``, a thread per rank that watches the step in progress: when it has run longer
  than ``max(10 x the median of recent steps, train.watchdog_min_s)``, it dumps every thread's
  Python stack (faulthandler) to ``RUN/diagnosis/stacks_rank{r}.txt``, writes this rank's
  state to ``RUN/diagnosis/stall_rank{r}.json``, and rank 0 reads the others' (the run
  directory is shared, as checkpoints need) and writes one line naming the rank that is
  behind and the collective each rank is in. The job goes on: a stall that resolves is
  reported again when its step ends; one that does not ends in the process group's timeout
  (``train.parallel.timeout_s``) as before, with the stacks already on disk.

Only training steps are watched (from the batch's wait to the end of the step's
bookkeeping); evaluation and checkpoints between epochs are not.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from genrec.train.observe import faults

STALL_FACTOR = 10.0  # a step this many times the recent median is a stall (and at least watchdog_min_s)
HISTORY = 50  # recent steps the median is taken over
MIN_HISTORY = 3  # steps before the first judgement (the first steps warm up)


class Collectives:
    """The collective calls this process has in progress (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entered = 0  # how many collectives this process has entered
        self.open: dict[int, dict[str, Any]] = {}  # sequence number -> {name, launched, since}
        self.rank = 0
        self.step = 0  # the training step in progress (for the test fault below)
        self._stalled: set[int] = set()

    def enter(self, name: str, launched: bool = True) -> int:
        """Registers a call (``launched=False``: entered, not yet handed to the backend);
        returns its token for ``launch`` / ``leave``."""
        with self._lock:
            self.entered += 1
            seq = self.entered
            self.open[seq] = {"name": name, "launched": launched, "since": time.time(), "seq": seq}
        self._maybe_stall()
        return seq

    def launch(self, seq: int) -> None:
        with self._lock:
            if seq in self.open:
                self.open[seq]["launched"] = True

    def leave(self, seq: int) -> None:
        with self._lock:
            self.open.pop(seq, None)

    @contextlib.contextmanager
    def call(self, name: str) -> Iterator[None]:
        seq = self.enter(name, launched=False)
        self.launch(seq)
        try:
            yield
        finally:
            self.leave(seq)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"entered": self.entered, "open": sorted((dict(v) for v in self.open.values()), key=lambda v: v["seq"])}

    def _maybe_stall(self) -> None:
        """A test's ``stall`` fault (:mod:`genrec.train.observe.faults`): this rank sleeps inside
        the first collective it enters during that step (before launching it), once."""
        seconds = faults.stall_seconds(self.rank, self.step)
        if seconds and self.step not in self._stalled:
            self._stalled.add(self.step)
            time.sleep(seconds)


COLLECTIVES = Collectives()


def collective(name: str) -> contextlib.AbstractContextManager:
    """``with collective("all_reduce (stop vote)"): dist.all_reduce(t)``: marks a blocking call."""
    return COLLECTIVES.call(name)


def describe(state: dict[str, Any], now: float) -> str:
    """'rank 1 in all_reduce (DDP bucket 0), entered 5.0 s ago, not launched' and the like."""
    if not state["open"]:
        top = state.get("top", "")
        return f"rank {state['rank']} in no collective" + (f" (at {top})" if top else "")
    c = state["open"][0]
    how = "waiting" if c["launched"] else "not launched"
    return f"rank {state['rank']} in {c['name']} for {now - c['since']:.1f} s ({how})"


def behind(states: list[dict[str, Any]]) -> list[int]:
    """The ranks that are behind the others: the fewest collectives entered, and among those
    the ones that have not launched the collective they are in (the others wait on them).
    Empty when every rank is at the same point (then none can be named)."""
    def progress(s: dict[str, Any]) -> tuple[int, int]:
        launched = all(c["launched"] for c in s["open"]) if s["open"] else True
        return s["entered"], int(launched)

    low = min(progress(s) for s in states)
    if all(progress(s) == low for s in states):
        return []
    return [s["rank"] for s in states if progress(s) == low]


def stall_summary(states: list[dict[str, Any]], step: int, elapsed: float, limit: float, now: float) -> str:
    """One line: the step, its time against the limit, the rank(s) behind, each rank's collective."""
    late = behind(states)
    head = f"step {step} has run {elapsed:.1f} s (limit {limit:.1f} s): "
    if late:
        head += f"rank {', '.join(map(str, late))} is behind; "
    elif len(states) > 1:
        head += "every rank is at the same point (a peer outside the job, or the network); "
    return head + "; ".join(describe(s, now) for s in sorted(states, key=lambda s: s["rank"]))


class Watchdog:
    """Watches the steps of one rank (see the module docstring). ``report(kind, line, **fields)``
    writes a diagnosis (``train.observe.diagnose.DiagnosisLog.write``)."""

    def __init__(self, diag_dir: Path, rank: int, world_size: int, min_s: float,
                 report: Callable[..., None], poll_s: float = 0.25) -> None:
        self.dir, self.rank, self.world_size = diag_dir, rank, world_size
        self.min_s, self.report, self.poll_s = min_s, report, poll_s
        self.enabled = min_s > 0
        self.recent: deque[float] = deque(maxlen=HISTORY)
        self.step, self.began = 0, 0.0  # the step in progress and its start (0: none)
        self.fired_step = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        COLLECTIVES.rank = rank

    # ----- the training thread's calls --------------------------------------------------------
    def step_begins(self, step: int) -> None:
        COLLECTIVES.step = step
        self.step, self.began = step, time.perf_counter()

    def step_ends(self) -> None:
        if not self.began:
            return
        took = time.perf_counter() - self.began
        self.began = 0.0
        if self.fired_step == self.step:
            self.report("stall_end", f"step {self.step} finished after {took:.1f} s (rank {self.rank})",
                        step=self.step, seconds=took)
        self.recent.append(took)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The watching thread, for the duration of an epoch."""
        if not self.enabled:
            yield
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="genrec-watchdog", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self.began = 0.0
            self._stop.set()
            self._thread.join()

    # ----- the watching thread ------------------------------------------------------------------
    def limit(self) -> float | None:
        if len(self.recent) < MIN_HISTORY:
            return None
        return max(STALL_FACTOR * statistics.median(self.recent), self.min_s)

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while not self._stop.wait(self.poll_s):
            began, step, limit = self.began, self.step, self.limit()
            if not began or limit is None or self.fired_step == step:
                continue
            elapsed = time.perf_counter() - began
            if elapsed > limit:
                self.fired_step = step
                self._fire(step, elapsed, limit, main)

    def _fire(self, step: int, elapsed: float, limit: float, main: int | None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        stacks = self.dir / f"stacks_rank{self.rank}.txt"
        with open(stacks, "a") as f:
            f.write(f"--- step {step}, {elapsed:.1f} s into it, {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        frame = sys._current_frames().get(main) if main is not None else None
        top = ""
        if frame is not None:
            fs = traceback.extract_stack(frame)[-1]
            top = f"{Path(fs.filename).name}:{fs.lineno} {fs.name}"
        now = time.time()
        state = {"rank": self.rank, "step": step, "elapsed": elapsed, "limit": limit, "time": now,
                 "top": top, "stacks": str(stacks), **COLLECTIVES.snapshot()}
        tmp = self.dir / f".stall_rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.dir / f"stall_rank{self.rank}.json")
        self.report("stall_rank", describe(state, now) + f" at step {step} ({elapsed:.1f} s); stacks in {stacks}",
                    printed=False, **{k: v for k, v in state.items() if k != "rank"})
        if self.rank != 0:
            return
        states = self._gather(state, limit)
        line = stall_summary(states, step, elapsed, limit, time.time())
        self.report("stall", line + f"; stacks in {self.dir}/stacks_rank*.txt", step=step, elapsed=elapsed,
                    limit=limit, behind=behind(states), ranks=states)

    def _gather(self, own: dict[str, Any], limit: float) -> list[dict[str, Any]]:
        """Rank 0: every rank's stall state written near this one (they fire when their own
        step passes its limit), waiting up to ``limit`` + 10 s for them."""
        deadline = time.time() + limit + 10
        states = {0: own}
        while len(states) < self.world_size and time.time() < deadline and not self._stop.is_set():
            for r in range(1, self.world_size):
                with contextlib.suppress(OSError, ValueError):
                    s = json.loads((self.dir / f"stall_rank{r}.json").read_text())
                    if abs(s["time"] - own["time"]) < 2 * limit + 10:
                        states[r] = s
            time.sleep(self.poll_s)
        return list(states.values())
