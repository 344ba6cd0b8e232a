"""The training job config, composed of each component's own config, and the builders.

A job is a TOML file in ``configs/`` plus dotted overrides::

    genrec train --config configs/hstu.toml --train.optim.lr=3e-4 --data.path=data/ml1m

Every section is owned by its component: ``[data]`` by the reader, ``[embedding]`` by the
feature spec, ``[model]`` by the model, ``[train]`` by the trainer, ``[eval]`` by the
evaluator, ``[run]`` by the run directory. Builders receive only their own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from genrec.config import ConfigError, load_config
from genrec.embedding.spec import EmbeddingConfig, prepare_ids
from genrec.models.dlrm import PooledDLRM
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.models.sid import SemanticIds
from genrec.models.sid_decoder import SIDConfig
from genrec.train.data.reader import DataConfig
from genrec.train.data.schema import DatasetInfo, read_info, read_items
from genrec.train.eval.evaluate import EvalConfig
from genrec.train.loop.parallel import ParallelConfig


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables


def resolve_precision(precision: str, device: torch.device | None) -> Literal["fp32", "bf16"]:
    """``train.precision`` as a training step runs it on ``device`` (None: the CPU): "auto"
    is "bf16" on a CPU with native bf16 GEMMs (AVX512-BF16 or AMX tiles, where they run at
    about twice the fp32 rate), "fp32" elsewhere (emulated bf16 is slower than fp32)."""
    if precision != "auto":
        return "bf16" if precision == "bf16" else "fp32"
    if device is not None and device.type != "cpu":
        return "fp32"
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return "bf16" if any(bool(f()) for f in checks if f is not None) else "fp32"


@dataclass(frozen=True)
class TrainConfig:
    max_epochs: int = 100
    # a run directory (its best checkpoint) or a checkpoint directory to start from: the model's
    # tensors it holds with the same shapes (e.g. a dense run under a new decoder head); 1 or N ranks
    init_from: str = ""
    max_steps: int = 0  # stop after this many optimizer steps in total; 0 = no limit
    time_budget_min: float = 0.0  # stop after this many minutes of training; 0 = no limit
    eval_every_epochs: int = 1
    patience: int = 10  # evaluations without improvement before stopping
    early_stop_metric: str = "ndcg@10"
    # how many consecutive evaluations the model is chosen on: the best mean of
    # early_stop_metric over a trailing window picks the tested checkpoint (the window's
    # newest) and patience counts from it; 1 = the single best evaluation. A small
    # validation set reads each epoch noisily; a window keeps one spike from choosing.
    select_window: int = 1
    # the one-standard-error rule: the tested checkpoint is the newest whose windowed
    # early_stop_metric is within this many standard errors (of the best window's
    # validation reading, over its users) of the best, and patience counts evaluations
    # below that line. A few hundred validation users cannot tell checkpoints closer than
    # that apart; among those, the newest has trained longest at the annealed LR.
    # 0 = the best window itself.
    select_within_se: float = 0.0
    # "bf16": autocast (bf16 GEMMs with fp32 accumulation, fp32 weights, optimizer and residual
    # stream; the full softmax's normaliser and loss in fp32). "auto": bf16 where the device runs
    # bf16 GEMMs natively faster than fp32 (a CPU with AVX512-BF16 or AMX tiles), else fp32
    # (GPUs included: not measured here); see resolve_precision
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    # torch.set_float32_matmul_precision for fp32 GEMMs. "medium" lets torch route them to
    # oneDNN, which may use bf16 inside where the CPU has fast bf16: faster there at fp32-level
    # error, no change elsewhere (benchmarks/train_speed.py measures both and the error).
    # "highest": torch's default.
    matmul_precision: Literal["highest", "high", "medium"] = "medium"
    seed: int = 0
    log_every_steps: int = 20
    checkpoint_every_steps: int = 0  # extra mid-epoch checkpoints; 0: only at evaluations
    keep_checkpoints: int = 2
    compile: bool = False
    # exponential moving average of the weights (train.loop.average): validation, the test and
    # checkpoints' model read the average; 0 = off. Not with sharded (DMP) tables.
    ema_decay: float = 0.0
    evaluate: bool = True  # false: train only (throughput runs): no validation, no test
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    progress: bool = True
    # where each logged interval's step time goes (data / forward / backward / optimizer,
    # collectives), model FLOPs, MFU and peak memory, in metrics.jsonl and on the progress bar
    # (train.observe.stepstats); on a GPU it synchronizes at each part's end, so false leaves it out
    step_stats: bool = True
    # "START:END": a torch.profiler trace and summary of steps START..END-1 in RUN/profile/
    # (train.observe.profiling); "" = none
    profile_steps: str = ""
    # a step whose loss exceeds this many times the median of the last 100 is flagged in
    # RUN/diagnosis.jsonl (train.observe.diagnose); 0 = no check
    loss_spike_factor: float = 3.0
    # a step running longer than max(10 x the recent median, this many seconds) dumps every
    # rank's stacks and names the rank behind and each rank's collective (train.observe.watchdog);
    # 0 = no watchdog
    watchdog_min_s: float = 60.0
    # a diagnosis file RUN/diagnosis/nonfinite_step<N>_rank<r>.json: run that step again from
    # its saved weights, batch and RNG state instead of training (train.observe.diagnose)
    replay: str = ""
    # also write metrics.jsonl's records as TensorBoard scalars to RUN/tensorboard/ (needs the
    # `tensorboard` extra; the run directory stays the source of truth)
    tensorboard: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"train.ema_decay = {self.ema_decay}: must be in [0, 1) (0 turns the average off)")
        if self.select_window < 1:
            raise ConfigError(f"train.select_window = {self.select_window}: must be 1 or more "
                              "(1 chooses on single evaluations)")
        if self.select_within_se < 0:
            raise ConfigError(f"train.select_within_se = {self.select_within_se}: must be 0 or more "
                              "(0 chooses the best window itself)")
        if self.loss_spike_factor != 0 and self.loss_spike_factor <= 1:
            raise ConfigError(f"train.loss_spike_factor = {self.loss_spike_factor}: must be above 1 (0 turns the check off)")
        if self.watchdog_min_s < 0:
            raise ConfigError(f"train.watchdog_min_s = {self.watchdog_min_s}: must be 0 or more (0 turns the watchdog off)")
        from genrec.train.observe.profiling import parse_steps

        parse_steps(self.profile_steps)  # names the field and the form when it is malformed
        if self.eval_every_epochs < 1:
            raise ConfigError(f"train.eval_every_epochs = {self.eval_every_epochs}: must be 1 or more "
                              "(train.evaluate = false trains without validation)")


@dataclass(frozen=True)
class RunConfig:
    out_dir: str = "runs"
    name: str = ""  # default: the config file's stem
    # a fixed id makes the run directory runs/<name>/<id>: a restarted job (torchrun
    # --max-restarts, a rescheduled pod) finds it and resumes from its newest checkpoint
    id: str = ""


@dataclass(frozen=True)
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)


def load_job(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    job = load_config(JobConfig, path, overrides)
    if path is not None and not job.run.name:
        job = replace(job, run=replace(job.run, name=Path(path).stem))
    return job


def resolve_embedding(cfg: EmbeddingConfig, info: DatasetInfo) -> EmbeddingConfig:
    """Sizes tables left without ``num_embeddings`` from the dataset manifest: the item
    table from the largest item id, ``action`` from the action bits (ids are bitmasks,
    0 = unknown), context tables from their cardinalities."""
    sizes = {cfg.item_feature: info.item_table_size, "action": 1 << len(info.action_names)}
    sizes.update(info.context_features)
    return cfg.resolved(sizes)


def task_masks(job: JobConfig, info: DatasetInfo) -> dict[str, int]:
    """Ranking task name -> bitmask over the dataset's actions ({} without ranking)."""
    return job.model.ranking.task_masks(info.action_names) if job.model.ranking.enabled else {}


def tokens_per_event(job: JobConfig) -> int:
    return 2 if job.model.ranking.enabled and job.model.ranking.encoding == "interleaved" else 1


def corpus_ids(data_path: str | Path, embedding: EmbeddingConfig) -> torch.Tensor:
    """The catalogue to rank against: every item in the logs, as table rows (sorted)."""
    ids, _ = read_items(data_path)
    rows = prepare_ids(embedding.item_table, embedding.item_feature, ids, where=f"{data_path}/items.parquet")
    return torch.from_numpy(np.unique(rows))


def build_model(job: JobConfig, sparse_device: torch.device | None = None) -> tuple[torch.nn.Module, EmbeddingConfig]:
    """The unsharded model for ``job``, its tables sized from the dataset (``sparse_device``
    "meta" leaves the tables for a sharder to create)."""
    info = read_info(job.data.path)
    emb = resolve_embedding(job.embedding, info)
    if job.model.arch == "dlrm":
        return PooledDLRM(job.model.ranking, emb), emb
    corpus = corpus_ids(job.data.path, emb)
    model = GenerativeRecommender(job.model, emb, corpus, sparse_device=sparse_device,
                                  sid=semantic_ids(job.model.sid, corpus))
    return model, emb


def semantic_ids(cfg: SIDConfig, corpus: torch.Tensor) -> SemanticIds | None:
    """The codebook ``model.sid.codebook`` names (None without ``model.sid``); it must give a
    code to every item of the catalogue, else the decoder could never reach the missing ones."""
    if not cfg.enabled:
        return None
    path = Path(cfg.codebook)
    if not path.exists():
        raise ConfigError(f"model.sid.codebook: {path} does not exist (write it with 'genrec sid build')")
    sid = SemanticIds.load(path)
    missing = ~torch.isin(corpus, sid.item_ids)
    if bool(missing.any()):
        raise ConfigError(f"model.sid.codebook {path} has no code for {int(missing.sum())} of the catalogue's "
                          f"{corpus.numel()} items (e.g. {int(corpus[missing][0])}): built for another dataset?")
    return sid
