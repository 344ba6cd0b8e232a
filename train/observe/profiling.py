"""A profile on request: ``--train.profile_steps=START:END`` records steps START..END-1
(numbered as metrics.jsonl numbers them, from 1) with ``torch.profiler`` on every rank:

    RUN/profile/trace_rank{r}.json     Chrome / Perfetto trace (https://ui.perfetto.dev), with
                                       each step's phases as ``genrec.<part>`` ranges
    RUN/profile/summary_rank{r}.txt    the phases' shares (the step clock of train.observe.stepstats),
                                       op time by kind, top operators by self time, and what
                                       bounds the step

Kinds of op time (self time, so a composite op such as aten::linear counts only its own
overhead and its aten::addmm is a GEMM; on CPU an op run inside the ``data`` or
``optimizer`` phase counts as that phase's): ``matmul`` (GEMMs, attention products),
``embedding`` (fbgemm / embedding lookups and their backward), ``optimizer`` (the update,
with zero_grad and clipping), ``comm`` (c10d collectives and TorchRec's ``## ... ##`` comm ranges,
waits included), ``other ops`` (elementwise, reductions, copies, indexing), ``data``
(everything under the data phase: the reader's numpy work and its few ops), and ``python``:
the own time of ranges (ours, modules', autograd nodes') and the time in the phases that
no event accounts for (the interpreter between ops). The step's phases come from the step clock, so the two views
add up to the same wall time. On a GPU the kinds are the device's kernel time instead.

The profile stops at END, at the end of the epoch, or when training stops, whichever comes
first.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from genrec.config import ConfigError
from genrec.train.observe.stepstats import PARTS, StepStats

MATMUL = ("mm", "matmul", "linear", "bmm", "addmv", "dot", "conv", "gemm", "scaled_dot_product", "baddbmm", "einsum")
COMM = ("all_to_all", "alltoall", "all2all", "_dist]", "all_reduce", "allreduce", "all_gather", "allgather", "broadcast", "barrier",
        "reduce_scatter", "c10d", "gloo", "nccl", "record_param_comms")
EMBEDDING = ("fbgemm", "embedding", "tbe", "[lookup]")
OPTIMIZER = ("_foreach", "adam", "adagrad", "sgd", "optimizer")


def parse_steps(spec: str) -> tuple[int, int] | None:
    """"START:END" -> (START, END): steps START..END-1; "" -> None."""
    if not spec:
        return None
    try:
        start, end = (int(x) for x in spec.split(":"))
    except ValueError:
        start = end = -1
    if not 1 <= start < end:
        raise ConfigError(f"train.profile_steps = '{spec}': write 'START:END' with 1 <= START < END, "
                          "e.g. '100:110' for steps 100 to 109")
    return start, end


def kind_of(name: str) -> str:
    """The kind of an event's self time, by its name (see the module docstring)."""
    n = name.lower()
    if n == "genrec.data":
        return "data"
    if n.startswith("## ") or any(k in n for k in COMM):
        return "comm"
    if any(k in n for k in EMBEDDING):
        return "embedding"
    if any(k in n for k in OPTIMIZER):
        return "optimizer"
    if "::" not in n:  # a range (ours, a module's, an autograd node's): its own time is Python's
        return "python"
    op = n.split("::")[-1].rstrip("_")  # in-place forms too: addmm_
    if any(op == k or op.startswith(k) or op.endswith(k) or f"_{k}" in op for k in MATMUL):
        return "matmul"
    return "other ops"


def bound(shares: dict[str, float], data_share: float) -> str:
    """A sentence on what bounds the step, from the kinds' shares of its wall time."""
    if data_share >= 0.3:
        return f"input: the step waits for data {data_share:.0%} of its time (reader threads, prefetch)"
    top = max(shares, key=shares.get)
    says = {
        "matmul": "compute in GEMMs: the MFU against the matmul peak says how close to the hardware it runs",
        "other ops": "elementwise, reduction and copy ops (memory traffic and per-op overhead), more than GEMMs: "
                     "fusing them (compile, fused kernels) or larger batches move it",
        "python": "Python and framework overhead between ops: larger batches, compile or fewer, larger ops move it",
        "comm": "communication: collectives (and waiting in them for other ranks)",
        "embedding": "embedding lookups and their updates (memory bandwidth)",
        "optimizer": "the optimizer update (memory bandwidth of the parameter and state sweep)",
    }
    return f"{says[top]} ({top} {shares[top]:.0%} of the step)"


class StepProfiler:
    """Starts and stops ``torch.profiler`` around the requested steps of one rank."""

    def __init__(self, spec: str, run_dir: Path, rank: int, device: torch.device | None, stats: StepStats) -> None:
        self.steps = parse_steps(spec)
        self.dir, self.rank, self.stats = run_dir / "profile", rank, stats
        self.cuda = device is not None and device.type == "cuda"
        self.prof: torch.profiler.profile | None = None
        self.first = self.last = 0
        self.written: Path | None = None

    def step_begins(self, step: int) -> None:
        if self.steps is None or self.prof is not None or self.written is not None:
            return
        start, end = self.steps
        if start <= step < end:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
            self.prof.__enter__()
            self.stats.profiling = True
            self.first, self.totals = step, dict(self.stats.totals)

    def step_ends(self, step: int) -> None:
        if self.prof is not None:
            self.last = step
            if step >= self.steps[1] - 1:
                self.close()

    def close(self) -> None:
        """Stops a profile in progress and writes its trace and summary."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.stats.profiling = False
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.dir / f"trace_rank{self.rank}.json"))
        phases = {k: self.stats.totals[k] - self.totals[k] for k in PARTS}
        text = summarize(prof, phases, self.first, self.last, self.rank, self.cuda)
        self.written = self.dir / f"summary_rank{self.rank}.txt"
        self.written.write_text(text)


def summarize(prof: Any, phases: dict[str, float], first: int, last: int, rank: int, cuda: bool = False,
              top: int = 15) -> str:
    """The text of ``summary_rank{r}.txt`` (see the module docstring)."""
    wall_us = 1e6 * sum(phases.values())
    steps = max(1, last - first + 1)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    by_kind: dict[str, float] = defaultdict(float)
    if cuda:
        for e in prof.key_averages():
            by_kind[kind_of(e.key)] += float(getattr(e, attr, 0.0) or 0.0)
    else:  # each event by its own name, or by the phase it ran in: data and optimizer ops are theirs
        for e in prof.events():
            t = float(e.self_cpu_time_total or 0.0)
            root = e
            while root.cpu_parent is not None:
                root = root.cpu_parent
            phase = {"genrec.data": "data", "genrec.optimizer": "optimizer"}.get(root.name)
            by_kind[phase or kind_of(e.name)] += t
    rows = []
    for e in prof.key_averages():
        t = float(getattr(e, attr, 0.0) or 0.0)
        if t > 0 and not e.key.startswith("ProfilerStep"):
            rows.append((t, e.key, e.count, kind_of(e.key)))
    rows.sort(reverse=True)
    total_ops = sum(by_kind.values()) or 1.0
    denom = total_ops if cuda else max(wall_us, total_ops)
    if not cuda:  # time in the phases no event holds: the interpreter between ops
        by_kind["python"] += max(0.0, wall_us - total_ops)
    shares = {k: v / denom for k, v in by_kind.items() if k != "data"}
    data_share = phases["data"] / max(sum(phases.values()), 1e-12)
    out = [f"profile of steps {first}-{last} on rank {rank}: {steps} steps, {wall_us / 1e3:.1f} ms of wall time, "
           f"{wall_us / 1e3 / steps:.1f} ms a step",
           "phases (step clock): " + ", ".join(f"{k} {v / max(sum(phases.values()), 1e-12):.1%}"
                                               for k, v in phases.items() if v > 0),
           f"op time by kind ({'device kernels' if cuda else 'self CPU time, share of the wall time'}): "
           + ", ".join(f"{k} {v / denom:.1%}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])),
           f"bound by: {bound(shares, data_share)}",
           "",
           f"top operators by self {'device' if cuda else 'CPU'} time:",
           f"  {'operator':<48} {'ms/step':>9} {'share':>7} {'calls/step':>10}  kind"]
    for t, key, count, kind in rows[:top]:
        out.append(f"  {key[:48]:<48} {t / 1e3 / steps:9.2f} {t / denom:7.1%} {count / steps:10.1f}  {kind}")
    return "\n".join(out) + "\n"
