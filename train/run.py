"""Builds and runs a training job: run directory, model, readers, optimizer, trainer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from train.data.reader import make_reader
from train.data.schema import read_info
from train.job import JobConfig, build_model, task_masks, tokens_per_event
from train.rundir import new_run_dir, write_run_files
from train.trainer import Trainer, build_optimizer


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


def run_training(job: JobConfig, run_dir: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Trains ``job`` in a new run directory (or resumes the one given); returns (dir, results)."""
    if job.train.threads:
        torch.set_num_threads(job.train.threads)
    seed_everything(job.train.seed)
    model, emb = build_model(job)
    resolved = replace(job, embedding=emb)
    if run_dir is None:
        run_dir = new_run_dir(job.run.out_dir, job.run.name)
        write_run_files(run_dir, resolved)
    msl = job.model.max_seq_len
    tasks = task_masks(job, read_info(job.data.path))
    retrieval = job.model.arch == "generative"
    splits = ["train"] + (["valid", "test"] if retrieval else [])
    splits += ["rank_valid", "rank_test"] if tasks and job.data.ranking.enabled else []
    readers = {s: make_reader(job.data, s, emb, msl, seed=job.train.seed, tasks=tasks,
                              tokens_per_event=tokens_per_event(job)) for s in splits}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, job.train.optim)
    train_model = model
    if job.train.compile:
        model.tower.compile(dynamic=True)
    valid = {k: v for k, v in readers.items() if k in ("valid", "rank_valid")}
    test = {k: v for k, v in readers.items() if k in ("test", "rank_test")}
    trainer = Trainer(job.train, job.eval, run_dir, train_model, model, optimizer,
                      readers["train"], valid, test, tasks=list(tasks))
    return run_dir, trainer.fit()
