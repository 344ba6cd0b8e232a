"""Fixtures for serving tests: tiny artifacts (ranking; ranking + semantic-ID decoder) and an
in-process server on a thread."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from genrec.config import to_dict
from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.loadtest.client import RecommenderClient
from genrec.models.hstu import HSTUConfig
from genrec.models.ranking import RankingConfig, TaskConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.models.sid import build_semantic_ids
from genrec.quant.artifact import Manifest, save_artifact
from genrec.quant.convert import QuantizeConfig, export, load_training_model, resolve_checkpoint
from genrec.quant.dense import dense_tensors
from genrec.quant.embeddings import table_tensors
from genrec.serve.contract import InProcessEngine
from genrec.serve.engine import TorchEngine
from genrec.serve.server import RecommenderServer, ServeConfig
from genrec.train.job import load_job
from genrec.train.loop.launch import run_training
from tests.conftest import tiny_job_overrides

RANKING_TOML = """
[data]
context_features = true
[data.ranking]
enabled = true
num_candidates = 4
[[embedding.tables]]
name = "item"
features = ["item"]
dim = 16
[[embedding.tables]]
name = "action"
features = ["action"]
dim = 16
[[embedding.tables]]
name = "region"
features = ["region"]
dim = 4
pooling = "sum"
[[model.ranking.tasks]]
name = "click"
actions = ["click"]
[[model.ranking.tasks]]
name = "conversion"
actions = ["conversion"]
[train]
early_stop_metric = "click/auc"
"""


def tiny_ranking_artifact(data: Path, out: Path, tower: str = "hstu", embeddings: str = "int8") -> Path:
    cfg = out / "rank.toml"
    cfg.write_text(RANKING_TOML)
    job = load_job(cfg, tiny_job_overrides(data, out / "runs") + ["--train.max_epochs=1", f"--model.tower={tower}",
                                                                   "--model.transformer.num_heads=2"])
    run_dir, _ = run_training(job)
    art = out / f"artifact-{tower}-{embeddings}"
    export(run_dir, art, QuantizeConfig(embeddings=embeddings), progress=False)
    return art


UNTRAINED_TASKS = (TaskConfig("click", ("click",)), TaskConfig("conversion", ("conversion",)))


def untrained_artifact(out: Path, ranking: bool = True, items: int = 200, window: int = 32, seed: int = 0) -> Path:
    """A small untrained HSTU model (2 heads, summed actions, a pooled context feature) written
    as an fp32 artifact in a second, no training: with ranking tasks (click, conversion) or,
    ``ranking=False``, retrieval only. Items 1..``items``; a history window of ``window`` events;
    ``seed``: its weights (another seed: another model under the same names)."""
    torch.manual_seed(seed)
    tables = (TableConfig("item", ("item",), dim=16, num_embeddings=items + 1),
              TableConfig("action", ("action",), dim=16, num_embeddings=8),
              TableConfig("region", ("region",), dim=8, num_embeddings=5, pooling="sum"))
    hstu = HSTUConfig(num_layers=2, num_heads=2, qk_dim=8, v_dim=8, dropout=0.0, num_time_buckets=16)
    tasks = UNTRAINED_TASKS if ranking else ()
    cfg = ModelConfig(tower="hstu", max_seq_len=window + 1, input_dropout=0.0, hstu=hstu,
                      ranking=RankingConfig(tasks=tasks, dropout=0.0))
    emb = EmbeddingConfig(tables=tables)
    m = GenerativeRecommender(cfg, emb, torch.arange(1, items + 1)).eval()
    manifest = Manifest(model=to_dict(cfg), embedding=to_dict(emb),
                        quantization={"embeddings": "fp32", "dense": "fp32", "row_alignment": 16})
    return save_artifact(out, manifest, {"embeddings.safetensors": table_tensors(m.sparse, "fp32"),
                                         "dense.safetensors": dense_tensors(m, "fp32")})


def tiny_dense_run(data: Path, out: Path, max_steps: int = 6) -> Path:
    """A tiny ranking run (RANKING_TOML, no decoder) trained a few steps: its run directory."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "rank.toml"
    cfg.write_text(RANKING_TOML)
    job = load_job(cfg, tiny_job_overrides(data, out / "runs") + ["--train.max_epochs=1",
                                                                   f"--train.max_steps={max_steps}"])
    run_dir, _ = run_training(job)
    return run_dir


def tiny_sid_artifact(data: Path, out: Path, embeddings: str = "fp32", dense: str = "fp32") -> Path:
    """A ranking model (RANKING_TOML) with a semantic-ID decoder, exported: a tiny dense run
    (``out/dense``) -> a codebook of its item vectors (``out/sid.safetensors``: 8 x 8 codes and
    a collision level) -> a run with ``model.sid`` (beam 20) for one epoch -> the artifact."""
    dense_run = tiny_dense_run(data, out / "dense")
    _, model = load_training_model(*resolve_checkpoint(dense_run))
    with torch.no_grad():
        vectors = model.item_embeddings(model.corpus_ids)
    codebook = out / "sid.safetensors"
    build_semantic_ids(model.corpus_ids, vectors, sizes=(8, 8), iters=10).save(codebook)
    cfg = out / "rank.toml"
    cfg.write_text(RANKING_TOML)
    job = load_job(cfg, tiny_job_overrides(data, out / "runs") + [
        "--train.max_epochs=1", "--model.sid.enabled=true", f'--model.sid.codebook="{codebook}"',
        "--model.sid.beam_width=20"])
    run_dir, _ = run_training(job)
    art = out / f"artifact-sid-{embeddings}-{dense}"
    export(run_dir, art, QuantizeConfig(embeddings=embeddings, dense=dense), progress=False)
    return art


ADMIN_TOKEN = "test-admin-token-0123456789"


def local_config(**kwargs) -> ServeConfig:  # noqa: ANN003
    """A server on a free loopback port with the engine in the test's process (the default
    engine process, with its standby, is what the tests that say ``engine_process=True`` check)."""
    return ServeConfig(**{"host": "127.0.0.1", "port": 0, "engine_process": False, **kwargs})


def admin_token_file() -> str:
    """A file holding ADMIN_TOKEN (readable by its owner only, as an operator would keep it)."""
    fd, path = tempfile.mkstemp(prefix="genrec-admin-token-")
    os.write(fd, ADMIN_TOKEN.encode())
    os.close(fd)
    return path


class ThreadedServer:
    """A RecommenderServer running its own event loop on a background thread. Admin is on (its
    own loopback port, ``admin_target``, token ADMIN_TOKEN) unless the config sets a token file."""

    def __init__(self, artifact: Path, cfg: ServeConfig | None = None, engine=None, build=None) -> None:  # noqa: ANN001
        cfg = cfg or local_config()
        if not cfg.admin.token_file:
            cfg = replace(cfg, admin=replace(cfg.admin, token_file=admin_token_file()))
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(self._make(str(artifact), engine, build))
        self.port = self.call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"
        self.admin_target = f"127.0.0.1:{self.server.admin_port}"

    def client(self, timeout_s: float = 2.0) -> RecommenderClient:
        """A client of this server, Admin included."""
        return RecommenderClient(self.target, timeout_s, admin_target=self.admin_target, admin_token=ADMIN_TOKEN)

    async def _make(self, artifact: str, engine, build) -> RecommenderServer:  # noqa: ANN001
        return RecommenderServer(self.cfg, artifact, engine, build=build)

    def call(self, coro):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=600)

    def stop(self, grace: float = 2.0) -> None:
        self.call(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class SlowEngine(InProcessEngine):
    """A real engine whose batches take at least ``delay`` seconds (a known capacity)."""

    def __init__(self, inner: TorchEngine, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.works_run = 0
        self.name, self.version, self.schema, self.manifest, self.tower, self.stages = (
            inner.name, inner.version, inner.schema, inner.manifest, inner.tower, inner.stages)

    def run(self, works):  # noqa: ANN001, ANN201
        time.sleep(self.delay)
        self.works_run += len(works)
        return self.inner.run(works)
