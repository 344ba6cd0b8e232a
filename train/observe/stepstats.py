"""Where a training step's time goes: always-on, cheap accounting per logged interval.

A step is cut into consecutive parts of one clock (``time.perf_counter``), so the parts tile
the interval between two log records::

    data       waiting for the reader's next batch, and its copy to the device
    forward    the model's forward (loss included)
    backward   loss.backward()
    optimizer  LR / zero_grad before the forward, clipping, the finiteness check, step()
    checkpoint mid-epoch checkpoints written in the interval
    other      the loop's own bookkeeping: losses read back, progress bar, logging

Each ``mark(part)`` charges the time since the previous mark to ``part``; ``take()`` closes
the interval: ``time_ms.step`` is its wall time over its steps, read from the clock
independently of the marks, and the parts (per step) add up to it unless a piece of the loop
escapes the marks (tests/test_stepstats.py checks they agree within 5%).

On CPU the marks read the clock and nothing else. On a GPU every mark first calls
``torch.cuda.synchronize()``, so a part is the device work issued in it: the boundaries are
after the batch's copy, after zero_grad, after the forward, after the backward and after the
optimizer step, plus the bookkeeping marks of the loop (five to seven syncs a step, which
cost the overlap of one step's launch with the previous step's kernels; ``train.step_stats =
false`` turns them off with the rest of the accounting).

Communication runs inside those parts and is reported beside them, not added to them
(``comm_ms``): ``all_to_all`` is the time the training thread was blocked in TorchRec's
embedding all-to-alls (their calls and ``wait()``s, in forward and backward; gloo and NCCL
run them asynchronously, so what is left is the exposed part); ``all_reduce`` is the wall
time during which at least one DDP gradient bucket was in flight, which overlaps the
backward: it says how long the reduction took, not how much of the backward it cost
(``train.loop.parallel`` installs both timers).

Model FLOPs are counted once, on the first batch of a process (``FlopCounterMode`` over a
forward and backward of its own, ``count_model_flops``, plus the causal-triangle GEMM work the
native and Triton attention kernels report through ``kernels.flops``, which the counter cannot
see; the optimizer's are left out, as MFU conventionally does), and the
achieved rate is reported against the machine's measured matmul peak in the dtype the model
computes in (``matmul_peak``, measured once and cached per machine). Batches are jagged, so
the count is that of the first batch: an estimate within the spread of the batches' sizes.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

PARTS = ("data", "forward", "backward", "optimizer", "checkpoint", "other")
SHORT = {"data": "d", "forward": "f", "backward": "b", "optimizer": "o", "checkpoint": "c", "other": "x"}


class CommTimes:
    """Collective times reported by the hooks ``train.loop.parallel`` installs; callbacks may run
    on the backend's threads (list appends and float adds are atomic under the GIL)."""

    def __init__(self) -> None:
        self.blocked_all_to_all = 0.0  # seconds the training thread spent in all-to-all calls and waits
        self.all_reduce: list[tuple[float, float]] = []  # (start, end) of each DDP bucket's reduction

    def add_all_to_all(self, seconds: float) -> None:
        self.blocked_all_to_all += seconds

    def add_all_reduce(self, start: float, end: float) -> None:
        self.all_reduce.append((start, end))

    def take(self) -> dict[str, float]:
        """Seconds of each kind since the last take (all_reduce: the union of the buckets'
        intervals, buckets reducing at once counted once)."""
        spans, self.all_reduce = sorted(self.all_reduce), []
        busy, end = 0.0, -1.0
        for s, e in spans:
            if e > end:
                busy += e - max(s, end)
                end = e
        out = {"all_to_all": self.blocked_all_to_all, "all_reduce": busy}
        self.blocked_all_to_all = 0.0
        return out


def peak_memory_mb(device: torch.device | None) -> float:
    """This process's high-water memory: the CUDA caching allocator's peak on a GPU, else
    the peak resident set size (what the OS counts, Python and the allocator's slack too)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cache_dir() -> Path:
    return Path(os.environ.get("GENREC_CACHE", Path.home() / ".cache" / "genrec"))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from genrec.train.runs.directory import cpu_identity

    return cpu_identity()[0] or "cpu"


def gemm_size(device: torch.device) -> int:
    """The side of the square GEMM the peak is measured on."""
    return 8192 if device.type == "cuda" else 1024


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, min_runs: int = 3, seconds: float = 0.5) -> float:
    """The best TFLOP/s of :func:`gemm_size`'s square GEMM in ``dtype`` over at least
    ``min_runs`` runs and about ``seconds`` (at most 50 runs), measured now (no cache)."""
    n = gemm_size(device)
    # a generator of its own: the training's RNG stream must not move (resumed runs compare equal)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.rand(n, n, generator=gen, device=device).to(dtype)
    b = torch.rand(n, n, generator=gen, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, spent, runs = float("inf"), 0.0, 0
    (a @ b).sum().item()  # warm-up: kernel choice, page faults
    while runs < min_runs or (spent < seconds and runs < 50):
        sync()
        t = time.perf_counter()
        a @ b
        sync()
        dt = time.perf_counter() - t
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return 2 * n**3 / best / 1e12


def matmul_peak(device: torch.device, dtype: torch.dtype, cache: Path | None = None) -> dict[str, Any]:
    """The best achieved TFLOP/s of a square GEMM in ``dtype`` on ``device`` with this
    process's threads and fp32 matmul precision: what MFU divides by. Measured once (about a
    second) and cached in ``cache`` (default ``~/.cache/genrec/matmul_peak.json``, or
    ``$GENREC_CACHE``) under the device, dtype, precision, threads and torch version. A
    machine busy with other work measures a lower peak (and so a higher MFU): the record
    keeps when it was measured."""
    path = (cache or cache_dir()) / "matmul_peak.json"
    key = (f"{_device_name(device)}|{dtype}|{torch.get_float32_matmul_precision()}|"
           f"threads={torch.get_num_threads()}|torch={torch.__version__}")
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    n = gemm_size(device)
    rec = {"tflops": measure_matmul_tflops(device, dtype), "gemm": f"{n}x{n}x{n}",
           "dtype": str(dtype).removeprefix("torch."), "matmul_precision": torch.get_float32_matmul_precision(),
           "threads": torch.get_num_threads(), "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    known[key] = rec
    with contextlib.suppress(OSError):  # a read-only home only loses the cache
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        tmp.replace(path)
    return rec


class FlopCount:
    """Counts the FLOPs of the aten ops run from its creation to ``finish()`` (matmuls,
    attention, convolutions: what torch's FlopCounterMode knows; elementwise ops count zero,
    as MFU does), plus what the native and Triton attention kernels report (``kernels.flops``:
    the counter cannot see them)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        from genrec.kernels import flops

        self.open = contextlib.ExitStack()
        self.kernel_flops = self.open.enter_context(flops.counter())
        self.counter = self.open.enter_context(FlopCounterMode(display=False))

    def finish(self) -> int:
        self.open.close()
        return int(self.counter.get_total_flops()) + self.kernel_flops[0]


def count_model_flops(model: torch.nn.Module, batch: Any, autocast: Callable[[], Any]) -> tuple[int, str]:
    """FLOPs of one training step's forward and backward of ``model`` on ``batch``, and how
    they were counted. A pass of its own, after the step: counting inside the step changes
    the kernels torch picks (ulp-level differences in gradients, which a resumed run would
    not share). The pass leaves the training as it was: the RNG state is restored, DDP
    reduces nothing (``no_sync``); the caller drops the gradients. With TorchRec's fused
    optimizers (DMP) a backward would update the tables, and a training-mode forward moves
    managed-collision tables (their counters and the ids they remap), so there the forward alone
    is counted, in eval mode, and the step taken as three times it (the backward's two GEMMs per
    forward GEMM)."""
    from genrec.train.loop import mch_state
    from genrec.train.loop.parallel import has_sharded_tables, no_sync

    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    try:
        if not has_sharded_tables(model) and not mch_state.modules(model):
            count = FlopCount()
            with no_sync(model):
                with autocast():
                    loss = model(batch)["loss"]
                loss.backward()
            return count.finish(), "forward and backward"
        was = model.training
        model.eval()
        try:
            count = FlopCount()
            with torch.no_grad(), autocast():
                model(batch)
            return 3 * count.finish(), "3 x forward"
        finally:
            model.train(was)
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)


class StepStats:
    """Per-interval step accounting for one rank; see the module docstring.

    Example (a loop of B-sample steps)::

        stats.start()
        with stats.phase("data"): batch = next(it)
        ...  # train_step marks optimizer / forward / backward / optimizer
        stats.count_step(); stats.mark("other")
        rec = stats.take()  # {"time_ms": {"step": ..., "data": ..., ...}, "comm_ms": ..., "mfu": ...}
    """

    def __init__(self, device: torch.device | None, enabled: bool = True, compute_dtype: torch.dtype = torch.float32) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.enabled = enabled
        self.compute_dtype = compute_dtype
        self.comm = CommTimes()
        self.flops_per_step: int | None = None  # counted on the first step (count_flops)
        self.peak: dict[str, Any] | None = None
        self.profiling = False  # train.observe.profiling turns each phase into a named trace range
        self.totals = dict.fromkeys(PARTS, 0.0)  # since start: what a profile's summary reads
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self._restart = False
        self.start()

    # ----- the clock ----------------------------------------------------------------------
    def start(self) -> None:
        """Opens a new interval now (its parts, steps and collectives' times at zero)."""
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.steps = 0
        self.comm.take()
        self.last = self.window_start = time.perf_counter()

    def mark(self, part: str) -> None:
        """Charges the time since the previous mark to ``part``."""
        if not self.enabled:
            return
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        self.parts[part] += now - self.last
        self.totals[part] += now - self.last
        self.last = now

    @contextlib.contextmanager
    def phase(self, part: str) -> Iterator[None]:
        """A block of the step charged to ``part`` (with the time since the last mark), and a
        ``genrec.<part>`` range in a profile's trace while one is recorded."""
        if not self.profiling:
            yield
            self.mark(part)
            return
        with torch.profiler.record_function(f"genrec.{part}"):
            yield
            self.mark(part)

    def count_step(self) -> None:
        """One more step in the interval; the step that counted the FLOPs (slowed by the
        counter) is left out: the interval starts again after it."""
        if self._restart:
            self._restart = False
            self.start()
        else:
            self.steps += 1

    # ----- once per run -------------------------------------------------------------------
    def wants_flops(self) -> bool:
        return self.enabled and self.flops_per_step is None

    def set_flops(self, flops: int, method: str = "forward and backward") -> dict[str, Any]:
        """Keeps the step's FLOP count and measures the matmul peak; returns the record that
        metrics.jsonl keeps of both (``kind: "flops"``). The step that counted is left out of
        the interval (``count_step``)."""
        self.flops_per_step = flops
        self.peak = matmul_peak(self.device, self.compute_dtype)
        self._restart = True
        return {"kind": "flops", "flops_per_step": flops, "counted": method, "peak_tflops": self.peak["tflops"],
                "peak": self.peak, "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                "device": _device_name(self.device)}

    # ----- per logged interval --------------------------------------------------------------
    def take(self) -> dict[str, Any]:
        """The interval since ``start`` / the last take, per step (empty when it holds no
        step or the accounting is off), and a new interval from now."""
        if not self.enabled or self.steps == 0:
            self.start()
            return {}
        now = time.perf_counter()
        wall, steps = now - self.window_start, self.steps
        rec: dict[str, Any] = {"time_ms": {"step": 1e3 * wall / steps,
                                           **{k: 1e3 * v / steps for k, v in self.parts.items()}}}
        comm = self.comm.take()
        if any(comm.values()):
            rec["comm_ms"] = {k: 1e3 * v / steps for k, v in comm.items()}
        if self.flops_per_step and self.peak:
            tflops = self.flops_per_step * steps / wall / 1e12
            rec["tflops"] = tflops
            rec["mfu"] = tflops / self.peak["tflops"]
        rec["peak_mem_mb"] = peak_memory_mb(self.device)
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.steps = 0
        self.window_start = now
        self.last = now
        return rec

    @staticmethod
    def postfix(rec: dict[str, Any]) -> dict[str, str]:
        """The progress bar's short form: ``ms=85=d3+f40+b30+o8+x4`` and ``mfu=1.2%``."""
        t = rec.get("time_ms")
        if not t:
            return {}
        parts = "+".join(f"{SHORT[k]}{t[k]:.0f}" for k in PARTS if t[k] >= 0.5)
        out = {"ms": f"{t['step']:.0f}={parts}"}
        if "mfu" in rec:
            out["mfu"] = f"{100 * rec['mfu']:.1f}%"
        return out
