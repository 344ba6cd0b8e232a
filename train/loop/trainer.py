"""The training loop: steps, schedule, validation, early stopping, checkpoints, test.

One ``Trainer`` serves one process or every rank of a distributed job: it is handed a
model that may already be parallelized (``train.loop.parallel``), plus the inner module for
evaluation, and a ``reduce`` function that sums tensors across ranks (identity alone).

Order of a run: resume from the newest checkpoint if there is one -> epochs of steps
(bf16 autocast optional, clipped AdamW, warmup + constant/cosine LR, optionally a moving
average of the weights, which validation and checkpoints then read) -> validation every
``eval_every_epochs`` with a checkpoint each time -> stop at ``max_epochs``, the time
budget or ``patience`` evaluations without improvement -> reload the chosen checkpoint (the
best on one evaluation, or on the mean of a trailing ``select_window`` of them; with
``select_within_se``, the newest within that many standard errors of the best) ->
with ranking tasks, fit the probability calibrator on ``rank_valid`` and write it into
that checkpoint (``train.eval.calibrate``) -> test -> ``results.json`` and ``curves.png``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from genrec.models.calibration import is_calibration_key
from genrec.train.data.reader import SequenceReader
from genrec.train.eval.calibrate import fit_calibration
from genrec.train.eval.evaluate import EvalConfig, evaluate
from genrec.train.eval.ranking_metrics import evaluate_ranking
from genrec.train.job import OptimConfig, TrainConfig, resolve_precision
from genrec.train.loop import checkpoint as ckpt
from genrec.train.loop import mch_state
from genrec.train.loop.average import AveragedWeights
from genrec.train.loop.parallel import full_params, time_collectives
from genrec.train.observe import faults
from genrec.train.observe.diagnose import Diagnoser
from genrec.train.observe.logs import log, progress
from genrec.train.observe.profiling import StepProfiler
from genrec.train.observe.stepstats import StepStats, count_model_flops
from genrec.train.observe.watchdog import Watchdog, collective
from genrec.train.runs.directory import MetricsLog, plot_curves


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of every group's base LR at ``step``: linear warmup, then constant or
    cosine down to ``min_lr_ratio`` (fused sparse groups follow the same schedule)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def all_reduce_max(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The element-wise maximum over the ranks, on ``device`` (NCCL reduces device tensors only)."""
    t = t.to(device) if device is not None else t.clone()
    with collective("all_reduce (max)"):
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank when ``flag`` is true on any rank (one all-reduce of one number)."""
    return bool(all_reduce_max(torch.tensor([int(flag)]), device).item())


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") else None


# RSS growth since the last trim that makes the trainer trim again (StepMemory): large enough
# that the trim's own cost (a walk of a GB heap) is paid every few dozen steps, not every step
TRIM_SLACK_MB = 256


def rss_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc/self/statm``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """torch's fp32 GEMM precision (``torch.set_float32_matmul_precision``) at ``precision``
    while the block runs, and the process's own again after it, whatever the block raised."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def as_served() -> contextlib.AbstractContextManager[None]:
    """fp32 GEMMs at the precision a server runs them (``serve.process.matmul_precision``'s
    default, "highest") while the block runs: evaluation and the calibrator's fit read the
    model as it will be served and as ``genrec eval`` reads it, whatever precision the job
    trains at (``train.matmul_precision``: "medium" lets a CPU with AMX run them in bf16)."""
    return matmul_precision("highest")


class StepMemory:
    """Trims the allocator (:func:`release_free_memory`) after a step once RSS has grown by
    ``TRIM_SLACK_MB`` since the last trim. Steps of new shapes leave freed memory in glibc's
    heap, not live tensors: without a trim within the epoch a large-table run's RSS climbs
    every step until the epoch ends (or the machine runs out); a trim returns it. A trim walks
    the heap, so it runs when there is that much to return, not every step (figures:
    benchmarks/notes/2026-12-05-trainer-rss.md)."""

    def __init__(self) -> None:
        self.floor = rss_bytes()

    def after_step(self) -> bool:
        """Trims if RSS is past the slack; returns whether it did."""
        now = rss_bytes()
        if now is None or self.floor is None or now - self.floor <= TRIM_SLACK_MB * 2**20:
            return False
        release_free_memory()
        self.floor = rss_bytes() or now
        return True


def release_free_memory() -> None:
    """Hands the allocator's free pages back to the OS (glibc ``malloc_trim``; elsewhere a
    no-op). CPU training allocates tensors of a new size every step (jagged batches), and
    glibc serves the large ones from its heap once its mmap threshold has risen to their
    size: freed, they leave holes that count in the process's RSS. On ML-1M (6 layers, one
    thread) RSS grew ~180 MB an epoch over epochs 4-9 without this and ~120 MB with it,
    measured side by side; a fixed 128 KB mmap threshold stopped the growth but slowed every
    step, where a trim once per epoch costs next to nothing."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    train_seconds: float = 0.0
    best_metric: float = -math.inf  # the best windowed validation reading so far
    best_se: float = 0.0  # its standard error (train.select_within_se)
    peak_epoch: int = -1  # the epoch where it was read
    best_step: int = -1  # the chosen checkpoint: the newest within the tolerance of the best
    best_epoch: int = -1
    evals_since_best: int = 0  # evaluations since the chosen one
    last_eval_step: int = -1
    # the epochs a cosine schedule spans when fitted to the time budget (Trainer.fit_schedule),
    # kept across resumes; 0: max_epochs
    schedule_epochs: int = 0
    stopped: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        eval_cfg: EvalConfig,
        run_dir: Path,
        model: torch.nn.Module,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_reader: SequenceReader,
        valid_readers: dict[str, SequenceReader],
        test_readers: dict[str, SequenceReader],
        *,
        tasks: list[str] | None = None,
        rank: int = 0,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        dense_params: list[torch.nn.Parameter] | None = None,
        device: torch.device | None = None,
        state_io: Any = None,
        world_size: int = 1,
    ) -> None:
        # "auto" precision decided once, for this device: the step and its accounting read the result
        cfg = replace(cfg, precision=resolve_precision(cfg.precision, device))
        self.cfg, self.eval_cfg, self.run_dir = cfg, eval_cfg, run_dir
        self.model, self.module, self.optimizer = model, module, optimizer
        self.train_reader, self.valid_readers, self.test_readers = train_reader, valid_readers, test_readers
        self.tasks = tasks or []
        self.rank, self.reduce, self.device = rank, reduce, device
        self.dense_params = dense_params if dense_params is not None else [p for p in module.parameters() if p.requires_grad]
        self.ckpt_root = run_dir / "checkpoints"
        self.io = state_io or ckpt.PlainState(model, optimizer)
        # the weights' moving average: what validation, the test and checkpoints' model read
        self.average = AveragedWeights(self.io, module, cfg.ema_decay) if cfg.ema_decay > 0 else None
        if self.average is not None:
            self.io = self.average
        self.world_size = world_size
        self.log = MetricsLog(run_dir / "metrics.jsonl", enabled=rank == 0, tensorboard=cfg.tensorboard)
        self.state = TrainState()
        self.steps_per_epoch = len(train_reader)
        # The schedule's base: each param group's LR as the optimizer was built from the config
        # (train.optim.lr; train.parallel.sparse_lr for fused tables), read here, before resume()
        # loads a checkpoint. Not kept in the groups: a checkpoint restores a group's current,
        # already decayed LR (or, for TorchRec's keyed optimizers, no group state at all), and a
        # base read back from it after a resume applied the schedule twice.
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        # a job that explains itself: step accounting (train.observe.stepstats), a profile on request
        # (train.observe.profiling), diagnoses of non-finite steps, spikes and resumes (train.observe.diagnose)
        # and of stalls (train.observe.watchdog)
        self.stats = StepStats(device, cfg.step_stats, torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
        if world_size > 1:  # the collectives' timers and the watchdog's markers
            time_collectives(model, self.stats.comm)
        self.profiler = StepProfiler(cfg.profile_steps, run_dir, rank, device, self.stats)
        self.diag = Diagnoser(run_dir, rank, world_size, device, cfg.loss_spike_factor, module)
        self.watchdog = Watchdog(self.diag.dir, rank, world_size, cfg.watchdog_min_s, self.diag.log.write)

    # ----- checkpoints --------------------------------------------------------------------
    def save(self) -> Path:
        body = {"trainer": self.state.__dict__, "reader": self.train_reader.state_dict(), "rng": ckpt.rng_state(),
                "device_rng": ckpt.device_rng_state(self.device)}
        path = ckpt.save_checkpoint(self.ckpt_root, self.state.step, self.io.state(), body,
                                    mch_state.capture(self.model))
        best = ckpt.step_dir(self.ckpt_root, self.state.best_step) if self.state.best_step >= 0 else None
        ckpt.prune_checkpoints(self.ckpt_root, self.cfg.keep_checkpoints, {best} if best else set())
        return path

    def _load(self, path: Path) -> dict[str, Any]:
        ckpt.restore(self.io, path)
        body = ckpt.load_trainer_state(path)
        if body.get("world_size") == self.world_size:  # (per rank: on another world size, a fresh schedule)
            mch_state.apply(self.model, ckpt.load_rank_tensors(path))
        return body

    def resume(self, path: Path | None = None) -> bool:
        """Resumes from ``path``, or else from the newest checkpoint that loads: a damaged newer
        one (truncated by a crash, a full disk) is set aside and named in the log with why."""
        if path is not None:
            body = self._load(path)
        else:
            found = ckpt.load_newest(self.ckpt_root, self._load)
            if found is None:
                self.diag.resumed(None, 0, 0, None)  # a torchrun restart says it starts over
                return False
            path, body, damaged = found
            for bad, why in damaged:
                self.diag.damaged_checkpoint(bad, why, path)
        self.state = TrainState(**{**body["trainer"], "stopped": ""})
        self.train_reader.load_state_dict(body["reader"])
        if body.get("world_size") == self.world_size:
            ckpt.set_rng_state(body["rng"])
            # on a GPU the model draws dropout and sampled negatives from the device's generator
            ckpt.set_device_rng_state(body.get("device_rng"), self.device)
        self.diag.resumed(path, self.state.step, self.state.epoch, body.get("world_size"))
        return True

    # ----- the loop -----------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.precision == "bf16":
            dev = self.device.type if self.device is not None else "cpu"
            return torch.autocast(dev, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def set_lr(self) -> None:
        """Sets every param group's LR for the coming step: a function of the step alone, so a
        resumed run follows the same schedule as an uninterrupted one."""
        factor = lr_factor(self.state.step, self.steps_per_epoch * self.last_epoch(), self.cfg.optim)
        for g, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            g["lr"] = base * factor
        # TorchRec's fused (in-backward) optimizers update their rows inside backward, with
        # the LR last handed to fbgemm, which their zero_grad() and step() do. Handing it over
        # before the forward makes the tables take this step's LR: otherwise they ran a step
        # behind the schedule (the full LR at the warm-up's first step) and, after a resume,
        # took their initial LR for the first step. The dense groups have no grads here.
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, batch: Any) -> dict[str, float]:
        """One optimizer step; returns the step's losses (``loss`` and its parts). Its parts are
        charged to the step clock (``self.stats``); the gradients' norm and the loss are checked
        before the update, and a non-finite one is diagnosed (``self.diag``: raises)."""
        stats = self.stats
        self.diag.step_begins(self.state.step + 1)
        with stats.phase("optimizer"):
            self.set_lr()
        with stats.phase("forward"):
            with self._autocast():
                losses = self.model(batch)
        loss = losses["loss"]
        with stats.phase("backward"):
            loss.backward()
        with stats.phase("optimizer"):
            if self.cfg.optim.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.dense_params, self.cfg.optim.grad_clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in self.dense_params if p.grad is not None])
            if self.diag.nonfinite(loss, norm):
                self.diag.explain(self, batch, losses, norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.average is not None:
                self.average.update()
        if stats.wants_flops() and not self.diag.replaying:  # once a process, on its first batch
            flops, how = count_model_flops(self.model, batch, self._autocast)
            self.optimizer.zero_grad(set_to_none=True)
            self.log.write(stats.set_flops(flops, how))
        self.state.step += 1
        stats.count_step()
        return {k: float(v.detach()) for k, v in losses.items()}

    def _out_of_time(self, started: float) -> bool:
        """Whether the time budget is spent: by any rank's clock when distributed, so that every
        rank leaves the epoch after the same step (ranks read their clocks at different moments;
        one rank stopping while another starts a step leaves that one waiting in a collective
        until gloo's timeout, and the job fails instead of testing its best checkpoint)."""
        budget = self.cfg.time_budget_min * 60
        if budget <= 0:
            return False
        spent = self.state.train_seconds + (time.perf_counter() - started) >= budget
        return any_rank(spent, self.device) if self.world_size > 1 else spent

    def run_epoch(self) -> None:
        """The rest of the current epoch, from the reader's position. Each step's time is
        charged to its parts (``self.stats``; the loop's own work to "other"), each logged
        record carries the interval's accounting, and the watchdog watches every step."""
        reader = self.train_reader
        bar = tqdm(total=self.steps_per_epoch, initial=reader.batches_done, desc=f"epoch {self.state.epoch}",
                   disable=not (self.cfg.progress and self.rank == 0), unit="step", leave=False)
        started = window_start = time.perf_counter()
        window_samples, losses = 0, {}
        self.model.train()
        stats, batches = self.stats, iter(reader)
        memory = StepMemory()
        stats.start()
        with self.watchdog.running():
            while True:
                self.watchdog.step_begins(self.state.step + 1)
                self.profiler.step_begins(self.state.step + 1)
                with stats.phase("data"):
                    batch = next(batches, None)
                    if batch is not None and self.device is not None:
                        batch = batch.to(self.device, non_blocking=True)
                if batch is None:
                    break
                step_losses = self.train_step(batch)
                memory.after_step()
                for k, v in step_losses.items():
                    losses.setdefault(k, []).append(v)
                self.diag.after_step(self.state.step, step_losses["loss"])
                window_samples += batch.batch_size
                bar.update(1)
                if self.state.step % self.cfg.log_every_steps == 0:
                    stats.mark("other")
                    now = time.perf_counter()
                    rate = window_samples / max(now - window_start, 1e-9)
                    rec = {"kind": "train", "step": self.state.step, "epoch": self.state.epoch,
                           **{k: sum(v) / len(v) for k, v in losses.items()},
                           **self.lr_record(), "samples_per_s": rate, **self.step_record()}
                    self.log.write(rec)
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", samples_s=f"{rate:.0f}", **stats.postfix(rec))
                    window_start, window_samples, losses = now, 0, {}
                if self.cfg.checkpoint_every_steps and self.state.step % self.cfg.checkpoint_every_steps == 0:
                    stats.mark("other")
                    self.state.train_seconds += time.perf_counter() - started
                    started = time.perf_counter()
                    self.save()
                    stats.mark("checkpoint")
                stop = ""
                if self._out_of_time(started):
                    stop = "time budget"
                elif self.cfg.max_steps and self.state.step >= self.cfg.max_steps:
                    stop = "max_steps"
                self.profiler.step_ends(self.state.step)
                stats.mark("other")
                self.watchdog.step_ends()
                if stop:
                    self.state.stopped = stop
                    break
                faults.kill_after_step(self.rank, self.state.step)  # a test's fault (observe.faults)
        self.profiler.close()
        self.state.train_seconds += time.perf_counter() - started
        bar.close()

    def step_record(self) -> dict[str, Any]:
        """The logged interval's step accounting (``train.observe.stepstats``); distributed, the peak
        memory of every rank (one small all-reduce: each rank fills its own slot)."""
        rec = self.stats.take()
        if rec and self.world_size > 1:
            mine = torch.zeros(self.world_size, dtype=torch.float64)
            mine[self.rank] = rec["peak_mem_mb"]
            rec["peak_mem_mb"] = [round(x, 1) for x in self.reduce(mine.to(self.device)).cpu().tolist()]
        return rec

    def lr_record(self) -> dict[str, Any]:
        """The LR of the step just taken: ``lr`` (the first param group's) and, when the optimizer
        has several groups (DMP: the fused tables' then the dense AdamW's), ``lr_groups``."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        return {"lr": lrs[0], **({"lr_groups": lrs} if len(lrs) > 1 else {})}

    def evaluate(self, readers: dict[str, SequenceReader]) -> dict[str, float]:
        """Retrieval metrics from the 'valid'/'test' reader, ranking metrics (keys
        ``<task>/<metric>``) from a 'rank_*' reader, merged into one dict. The test (read
        once, at the end) also draws its reliability diagram: ``reliability_test.png``."""
        out: dict[str, float] = {}
        for split, reader in readers.items():
            reader.set_epoch(0)
            total = None
            if self.world_size > 1:  # every rank must make as many (collective) forwards
                total = int(self.reduce_max(torch.tensor([len(reader)])).item())
            batches = progress(reader, split, enabled=self.cfg.progress and self.rank == 0)
            # FSDP: the whole dense part, for methods besides forward; fp32 GEMMs as a server runs them
            with full_params(self.module), as_served():
                if split.startswith("rank_"):
                    plot = self.run_dir / "reliability_test.png" if split == "rank_test" and self.rank == 0 else None
                    out.update(evaluate_ranking(self.module, batches, self.tasks, self.device, total, plot))
                else:
                    out.update(evaluate(self.module, batches, self.eval_cfg, self.device, self.reduce, total))
        return out

    def reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.world_size == 1 else all_reduce_max(t, self.device)

    def validate(self) -> dict[str, float]:
        if not self.valid_readers:  # no validation split (data.valid_users = 0): the latest model is the one tested
            self.state.last_eval_step = self.state.best_step = self.state.step
            self.state.best_epoch = self.state.epoch
            return {}
        with self.average.applied() if self.average is not None else contextlib.nullcontext():
            metrics = self.evaluate(self.valid_readers)
        rec = {"kind": "eval", "split": "valid", "step": self.state.step, "epoch": self.state.epoch,
               "train_seconds": self.state.train_seconds, **metrics}
        self.log.write(rec)
        self.state.last_eval_step = self.state.step
        metric = self.cfg.early_stop_metric
        keys = ("epoch", "step", "hr@10", "ndcg@10", metric, f"{metric}_se")
        self.state.history.append({k: rec[k] for k in keys if k in rec})
        if metric not in metrics:
            raise ValueError(f"train.early_stop_metric '{metric}' is not among the "
                             f"validation metrics: {sorted(metrics)}")
        value, se = self.windowed_metric()
        st = self.state
        if value > st.best_metric:
            st.best_metric, st.best_se, st.peak_epoch = value, se, st.epoch
        # the newest evaluation within the tolerance is chosen; the best one always is. Once
        # chosen, a checkpoint is only replaced by a newer one, so one step index suffices.
        if value >= st.best_metric - self.cfg.select_within_se * st.best_se:
            st.best_step, st.best_epoch, st.evals_since_best = st.step, st.epoch, 0
        else:
            st.evals_since_best += 1
        shown = " ".join(f"{k} {metrics[k]:.4f}" for k in ("hr@10", "ndcg@10", *(f"{t}/auc" for t in self.tasks))
                         if k in metrics)
        name = metric + (f" (mean of {self.cfg.select_window})" if self.cfg.select_window > 1 else "")
        chosen = (f", chosen epoch {st.best_epoch} (within {self.cfg.select_within_se:g} se)"
                  if self.cfg.select_within_se > 0 else "")
        log.info(
            f"epoch {st.epoch:3d} step {st.step:6d} | valid {shown} | best {name} {st.best_metric:.4f} "
            f"+- {st.best_se:.4f} @ epoch {st.peak_epoch}{chosen} | {st.train_seconds:.0f}s"
        )
        return metrics

    def windowed_metric(self) -> tuple[float, float]:
        """The mean of ``early_stop_metric`` over the newest ``select_window`` evaluations
        (fewer at the start of a run), what chooses the checkpoint and resets patience, and
        its standard error: the window's mean per-evaluation one (the evaluations read the
        same users, so averaging them barely narrows it)."""
        name = self.cfg.early_stop_metric
        window = self.state.history[-self.cfg.select_window:]
        se = sum(h.get(f"{name}_se", 0.0) for h in window) / len(window)
        return sum(h[name] for h in window) / len(window), se

    def fit(self) -> dict[str, Any]:
        """Trains to a stop condition, then tests the best checkpoint; returns results."""
        if self.cfg.replay:  # one saved step run again instead (train.observe.diagnose)
            return self.diag.replay(self, Path(self.cfg.replay))
        self.resume()
        head = getattr(self.module, "ranking", None)
        if head is not None:  # a resumed checkpoint's calibration fits weights that train on: refit in finish()
            head.calibrator.reset()
        cfg = self.cfg
        while not self.state.stopped:
            # every stop rule read again here, not only where it first fires: a run resumed from the
            # checkpoint written as it stopped (a worker killed in its test) stops again, as it did
            if self.state.epoch >= cfg.max_epochs:
                self.state.stopped = "max_epochs"
                break
            if self.state.schedule_epochs and self.state.epoch >= self.state.schedule_epochs:
                self.state.stopped = "time budget"  # (its schedule, fitted to it, has run out)
                break
            if cfg.max_steps and self.state.step >= cfg.max_steps:
                self.state.stopped = "max_steps"
                break
            if cfg.evaluate and self.state.last_eval_step >= 0 and self.state.evals_since_best >= cfg.patience:
                self.state.stopped = f"no improvement in {cfg.patience} evaluations"
                break
            if self._out_of_time(time.perf_counter()):
                self.state.stopped = "time budget"
                break
            self.run_epoch()
            if self.state.stopped:
                break
            self.state.epoch += 1
            self.train_reader.set_epoch(self.state.epoch)
            self.fit_schedule()
            release_free_memory()
            if not cfg.evaluate:
                continue
            if self.state.epoch % cfg.eval_every_epochs == 0 or self.state.epoch == self.last_epoch():
                self.validate()
                self.save()  # (patience, if spent, stops the run at the loop's top, as after a resume)
        if not cfg.evaluate:
            self.save()
            return self.summary()
        if self.state.last_eval_step != self.state.step:
            self.validate()
            self.save()
        return self.finish()

    def fit_schedule(self) -> None:
        """Fits a cosine schedule to ``time_budget_min``, after every epoch: where the epochs left
        at the run's mean pace so far (the slowest rank's; the first epoch's warm-up included,
        which errs short) do not reach the schedule's end, the schedule is shortened to the epochs
        that fit, so that it anneals to its floor as the budget runs out instead of the budget
        cutting it off part-way down. Only ever shortened (the rate never rises again); the
        length is kept in the trainer's state, so a resume continues it. Where ``max_epochs``
        fits, nothing changes."""
        cfg = self.cfg
        if cfg.time_budget_min <= 0 or cfg.optim.schedule != "cosine" or self.state.epoch < 1:
            return
        spent_s = self.state.train_seconds
        if self.world_size > 1:
            spent_s = float(all_reduce_max(torch.tensor([spent_s], dtype=torch.float64), self.device).item())
        pace = spent_s / self.state.epoch
        fits = self.state.epoch + max(1, int((cfg.time_budget_min * 60 - spent_s) // max(pace, 1e-9)))
        if fits >= self.last_epoch():
            return
        self.state.schedule_epochs = fits
        log.info(f"time budget: {cfg.time_budget_min:g} min at {pace:.0f} s an epoch fits {fits} of "
                 f"max_epochs {cfg.max_epochs}: the cosine schedule now spans {fits} epochs")

    def last_epoch(self) -> int:
        """The epoch the LR schedule ends at and the run after, unless another rule stops it
        first: a schedule fitted to the time budget (always shorter), else ``max_epochs``."""
        return self.state.schedule_epochs or self.cfg.max_epochs

    def calibrate(self, best: Path) -> dict[str, Any] | None:
        """Fits the ranking head's calibrator on ``rank_valid`` with the chosen checkpoint
        (loaded) and writes it into that checkpoint, then loads it again as evaluated; what
        results.json keeps of the fit, or None (no ranking tasks or no rank_valid split, or
        ``model.ranking.calibration = "none"``)."""
        head = getattr(self.module, "ranking", None)
        reader = self.valid_readers.get("rank_valid")
        if head is None or reader is None or head.cfg.calibration == "none":
            return None
        reader.set_epoch(0)
        total = int(self.reduce_max(torch.tensor([len(reader)])).item()) if self.world_size > 1 else None
        batches = progress(reader, "calibration", enabled=self.cfg.progress and self.rank == 0)
        with full_params(self.module), as_served():
            summary = fit_calibration(self.module, batches, self.tasks, self.device, total, self.reduce, self.rank,
                                      self.world_size, self.run_dir / "reliability_valid.png" if self.rank == 0 else None)
        fitted = {k: v.clone() for k, v in self.module.named_buffers() if is_calibration_key(k)}
        ckpt.amend_checkpoint(self.io, best, self.module, fitted)
        ckpt.restore(self.io, best, with_optimizer=False)  # the evaluated weights (averages), calibrated
        log.info("calibration: " + ", ".join(
            f"{t} ECE {m['ece_uncalibrated']:.4f} -> {m['ece']:.4f} ({m['knots']} knots)"
            for t, m in summary["tasks"].items()) + " on rank_valid")
        return summary

    def summary(self) -> dict[str, Any]:
        """Results of a train-only run (``train.evaluate = false``)."""
        results = {"stopped": self.state.stopped, "epochs": self.state.epoch, "steps": self.state.step,
                   "train_seconds": round(self.state.train_seconds, 1)}
        if self.rank == 0:
            (self.run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
        return results

    def finish(self) -> dict[str, Any]:
        best = ckpt.step_dir(self.ckpt_root, self.state.best_step)
        ckpt.restore(self.io, best, with_optimizer=False)
        calibration = self.calibrate(best)
        results: dict[str, Any] = {
            "stopped": self.state.stopped,
            "epochs": self.state.epoch,
            "steps": self.state.step,
            "train_seconds": round(self.state.train_seconds, 1),
            "best_epoch": self.state.best_epoch,
            "best_step": self.state.best_step,
            "best_checkpoint": best.name,
            "valid": next((h for h in self.state.history[::-1] if h["step"] == self.state.best_step), None),
        }
        if (self.cfg.select_window > 1 or self.cfg.select_within_se > 0) and self.valid_readers:
            results["select_window"] = self.cfg.select_window
            results["select_within_se"] = self.cfg.select_within_se
            metric = self.cfg.early_stop_metric
            results["valid_peak"] = {"epoch": self.state.peak_epoch, metric: self.state.best_metric,
                                     f"{metric}_se": self.state.best_se}
        if calibration is not None:
            results["calibration"] = calibration
        if self.test_readers:
            test = self.evaluate(self.test_readers)
            self.log.write({"kind": "eval", "split": "test", "step": self.state.best_step,
                            "epoch": self.state.best_epoch, **test})
            results["test"] = test
        if self.rank == 0:
            (self.run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
        return results
