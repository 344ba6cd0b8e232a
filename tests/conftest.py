"""Shared fixtures: tiny seeded datasets and configs (the suite never reads ../shared/data)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
# Triton reads this when it is first imported (SGLang imports it too): without a GPU the
# kernel tests run in Triton's interpreter.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from genrec.train.data.synthetic import SyntheticConfig, generate

    out = tmp_path_factory.mktemp("synth") / "data"
    cfg = SyntheticConfig(num_users=300, num_items=600, num_topics=8, median_len=12, max_len=60, seed=3,
                          chunk_users=128)
    generate(cfg, out, progress=False)
    return out


def tiny_job_overrides(data: Path, out: Path) -> list[str]:
    return [
        f'--data.path="{data}"',
        "--data.batch_size=32",
        "--data.eval_batch_size=64",
        "--model.max_seq_len=32",
        "--model.hstu.qk_dim=16",
        "--model.hstu.v_dim=16",
        "--model.retrieval.num_negatives=32",
        "--train.progress=false",
        "--train.log_every_steps=2",
        f'--run.out_dir="{out}"',
    ]


TINY_TABLES = """
[[embedding.tables]]
name = "item"
features = ["item"]
dim = 16
"""


@pytest.fixture()
def tiny_config(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(TINY_TABLES)
    return p
