"""Builds and runs a training job: process group, run directory, model, readers, trainer.

One entry for every launch: ``genrec train`` (one process) and
``torchrun --nnodes N --nproc-per-node M -m genrec.cli train ...`` (each rank runs this).
"""

from __future__ import annotations

import gc
import json
import resource
import shutil
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from genrec.config import ConfigError, dump_toml
from genrec.embedding.spec import IdOutOfRange
from genrec.train.data.reader import make_reader
from genrec.train.data.schema import DataFormatError, read_info
from genrec.train.job import JobConfig, build_model, task_masks, tokens_per_event
from genrec.train.loop import checkpoint as ckpt
from genrec.train.loop.checkpoint import warm_start
from genrec.train.loop.parallel import (
    DistContext,
    checkpoint_layers,
    init_distributed,
    parallelize,
    replicate,
    strategy,
)
from genrec.train.loop.trainer import Trainer, build_optimizer, matmul_precision
from genrec.train.observe.logs import log, run_log
from genrec.train.runs.directory import new_run_dir, remove_unused_run_dir, write_run_files


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


# what a job under an existing run.id may change: how long it trains and whether it shows progress
# (a restart is the same command; a longer schedule extends the run)
RESTART_KEYS = ("train.max_epochs", "train.max_steps", "train.time_budget_min", "train.progress")


def other_config(run_dir: Path, resolved: JobConfig) -> str:
    """What differs between the run ``run_dir`` holds and ``resolved`` (beyond RESTART_KEYS),
    as a message; "" where it is the same run."""
    from genrec.train.runs.browse import config_differences

    diff = config_differences(tomllib.loads((run_dir / "config.toml").read_text()), tomllib.loads(dump_toml(resolved)),
                              RESTART_KEYS)
    if not diff:
        return ""
    shown = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in list(diff.items())[:4])
    return (f"run.id {resolved.run.id!r}: {run_dir} holds a run of another config ({shown}"
            f"{'; ...' if len(diff) > 4 else ''}); give a new run.id, or resume that run as it is (--resume)")


def resolve_run_dir(job: JobConfig, resolved: JobConfig, ctx: DistContext, run_dir: Path | None) -> Path:
    """Rank 0 picks the directory (new, or ``run.id``'s, or the one resumed), others follow.
    A ``run.id`` whose directory holds a run of another config is refused on every rank."""
    if run_dir is None:
        if ctx.rank == 0:
            refused = ""
            if job.run.id:
                run_dir = Path(job.run.out_dir) / (job.run.name or "run") / job.run.id
                fresh = not (run_dir / "config.toml").exists()
                refused = "" if fresh else other_config(run_dir, resolved)
                run_dir.mkdir(parents=True, exist_ok=True)
            else:
                run_dir, fresh = new_run_dir(job.run.out_dir, job.run.name), True
            if fresh:
                write_run_files(run_dir, resolved)
                if resolved.model.sid.enabled:  # the codebook stays with the run (genrec eval --run finds it)
                    shutil.copyfile(resolved.model.sid.codebook, run_dir / "sid.safetensors")
        got = ctx.broadcast(("!" + refused if refused else str(run_dir)) if ctx.rank == 0 else "")
        if got.startswith("!"):
            raise ConfigError(got[1:])
        run_dir = Path(got)
    ctx.barrier()
    return run_dir


def _log_init_from(start: Path, left: list[str]) -> None:
    log.info(f"init_from {start}: {len(left)} tensors not in it, as initialised "
             f"({', '.join(sorted({k.split('.')[0] for k in left})) or 'none'})")


def run_training(job: JobConfig, run_dir: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Trains ``job`` (or resumes ``run_dir``); returns (run dir, results). Under torchrun every
    rank calls this; rank 0 writes files and returns the results the others also get."""
    if job.train.threads:
        torch.set_num_threads(job.train.threads)
    # the process's setting, given back on return: a job trained in-process (genrec demo, a
    # test's fixture) once left "medium" behind, and on a CPU with AMX every later fp32 GEMM of
    # the process (evaluation, an in-process server) ran in bf16
    with matmul_precision(job.train.matmul_precision):
        return _run_training(job, run_dir)


def _run_training(job: JobConfig, run_dir: Path | None) -> tuple[Path, dict[str, Any]]:
    ctx = init_distributed(job.train.parallel)
    new_dir = run_dir is None and not job.run.id  # a run.id dir is a restart's to find: never removed
    state: dict[str, Any] = {}
    try:
        run_dir, results = _train(job, run_dir, ctx, state)
        # the model, its DDP / DMP wrappers, the trainer and the readers (which hold the process
        # group and the data pipeline) were freed as _train returned, on every rank, before any
        # rank leaves: a torchrun worker once hung in such a teardown after its peer had exited
        gc.collect()
        ctx.barrier()
        return run_dir, results
    except (DataFormatError, IdOutOfRange):
        # a damaged row group found mid-epoch: drop the new run dir if it holds nothing but its start files
        run_dir = state.get("run_dir", run_dir)
        if new_dir and run_dir is not None and ctx.rank == 0:
            remove_unused_run_dir(run_dir)
        raise
    finally:
        # no barrier on failure: a dead peer would turn a clean error into a hang
        if ctx.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train(job: JobConfig, run_dir: Path | None, ctx: DistContext, state: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """run_training's work; ``state["run_dir"]`` is the run directory once chosen."""
    seed_everything(job.train.seed)
    how = strategy(job.train.parallel) if ctx.distributed else "none"
    if how == "dmp" and job.train.ema_decay > 0:
        raise ConfigError("train.ema_decay averages unsharded weights; TorchRec's sharded tables (train.loop.parallel."
                          "mode = 'dmp') are not averaged: set train.ema_decay = 0 or mode = 'ddp'")
    # DMP materializes the (sharded) tables itself; a replica builds them whole
    model, emb = build_model(job, sparse_device=torch.device("meta") if how == "dmp" else None)
    resolved = replace(job, embedding=emb)
    msl = job.model.max_seq_len
    tasks = task_masks(job, read_info(job.data.path))
    retrieval = job.model.arch == "generative"
    splits = ["train"] + ((["valid"] if job.data.valid_users > 0 else []) + ["test"] if retrieval else [])
    splits += ["rank_valid", "rank_test"] if tasks and job.data.ranking.enabled else []
    if not job.eval.test:
        splits = [s for s in splits if s not in ("test", "rank_test")]
    per_rank = replace(job.data, batch_size=max(1, job.data.batch_size // ctx.world_size))
    readers = {s: make_reader(per_rank, s, emb, msl, seed=job.train.seed, rank=ctx.rank, world_size=ctx.world_size,
                              tasks=tasks, tokens_per_event=tokens_per_event(job)) for s in splits}
    # only now, with the dataset's files opened and their schemas checked: bad data leaves no run dir
    run_dir = resolve_run_dir(job, resolved, ctx, run_dir)
    state["run_dir"] = run_dir
    with run_log(run_dir, ctx.rank):
        version = json.loads((run_dir / "version.json").read_text()) if (run_dir / "version.json").exists() else {}
        log.info(f"run {run_dir}: commit {(version.get('commit') or 'unknown')[:12]}"
                 f"{' (dirty)' if version.get('dirty') else ''}, {ctx.world_size} rank(s){f' ({how})' if ctx.distributed else ''}, "
                 f"data {job.data.path}, torch {torch.__version__}, {torch.get_num_threads()} threads")
        valid = {k: v for k, v in readers.items() if k in ("valid", "rank_valid")}
        test = {k: v for k, v in readers.items() if k in ("test", "rank_test")}
        optim = job.train.optim

        def dense_optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001
            return build_optimizer(list(params), optim)

        if ctx.distributed:
            par = (replicate(model, emb, dense_optimizer, ctx, job.train.parallel) if how == "ddp" else
                   parallelize(model, emb, job.train.parallel, optim.lr, dense_optimizer, ctx, per_rank.batch_size))
            if job.train.compile:
                par.module.tower.compile(dynamic=True)
            if ctx.rank == 0:
                (run_dir / "sharding.json").write_text(json.dumps(par.describe(), indent=2) + "\n")
            if job.train.init_from:  # into the shards, before fit(): a resumed run's own checkpoint overrides it
                _, start = ckpt.resolve_checkpoint(job.train.init_from)
                _log_init_from(start, ckpt.warm_start_state(par, start))
            trainer = Trainer(job.train, job.eval, run_dir, par.model, par.module, par.optimizer,
                              readers["train"], valid, test, tasks=list(tasks), rank=ctx.rank, reduce=ctx.reduce,
                              dense_params=par.dense_params, device=ctx.device, state_io=par,
                              world_size=ctx.world_size)
        else:
            model = model.to(ctx.device)
            if job.train.parallel.activation_checkpointing:
                checkpoint_layers(model)
            optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], optim)
            if job.train.compile:
                model.tower.compile(dynamic=True)
            if job.train.init_from:  # before fit(): a resumed run's own checkpoint then overrides it
                _, start = ckpt.resolve_checkpoint(job.train.init_from)
                _log_init_from(start, warm_start(model, start))
            trainer = Trainer(job.train, job.eval, run_dir, model, model, optimizer,
                              readers["train"], valid, test, tasks=list(tasks), device=ctx.device)
        results = trainer.fit()
        log.info("results: " + json.dumps(results, default=str), extra={"file_only": True})
        peak = {"rank": ctx.rank, "world_size": ctx.world_size,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        (run_dir / f"memory.rank{ctx.rank}.json").write_text(json.dumps(peak) + "\n")
        ctx.barrier()
        return run_dir, results
