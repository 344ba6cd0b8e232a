"""A run's directory: everything needed to compare or reproduce it later.

    runs/<name>/<YYYYmmdd-HHMMSS>/
      config.toml      the resolved job config (tables sized, defaults filled)
      version.json     git commit and whether the tree was dirty
      env.json         python / torch / torchrec / fbgemm versions, CPU, threads, world size
      metrics.jsonl    one JSON object per log step and per evaluation
      checkpoints/     DCP checkpoints (see train.loop.checkpoint)
      curves.png       training loss and validation metrics
      results.json     best validation and the test metrics at the best checkpoint
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from genrec.config import dump_toml


def code_version() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    return {"commit": commit or None, "dirty": bool(git("status", "--porcelain")) if commit else None}


# instruction-set features that change CPU kernel speed (oneDNN / MKL / inductor pick code by them)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_identity(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[str | None, list[str]]:
    """('<model name> (family F model M, <ISA>)', ISA flags present) from ``cpuinfo``: a VM
    can land on another CPU generation under the same model name, and the figures move with it."""
    info: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for ln in f:
                if not ln.strip():
                    break  # the first processor is enough
                k, _, v = ln.partition(":")
                info[k.strip()] = v.strip()
    except OSError:
        return None, []
    flags = set(info.get("flags", "").split())
    isa = [f for f in ISA_FLAGS if f in flags]
    name = info.get("model name")
    if name and "cpu family" in info:
        name = f"{name} (family {info['cpu family']} model {info.get('model', '?')}, {'+'.join(isa) or 'no AVX2'})"
    return name, isa


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
    }
    for mod in ("torchrec", "fbgemm_gpu", "triton", "pyarrow"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing or broken optional package is just unrecorded
            env[mod] = None
    env["cpu"], env["isa"] = cpu_identity()
    return env


def new_run_dir(out_dir: str | Path, name: str) -> Path:
    base = Path(out_dir) / (name or "run")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = base / stamp
    i = 1
    while path.exists():
        path = base / f"{stamp}-{i}"
        i += 1
    path.mkdir(parents=True)
    return path


RUN_START_FILES = ("config.toml", "version.json", "env.json", "sharding.json")


def remove_unused_run_dir(path: Path) -> bool:
    """Deletes a run directory (and its then empty ``runs/<name>``) that holds only the files
    written as it started: what a job that failed on its data before its first logged step
    leaves behind, which nothing can resume or evaluate. True if it was removed."""
    def start_file(name: str) -> bool:  # the log files too: what they say was printed as the job failed
        return name in RUN_START_FILES or (name.startswith("train.") and name.endswith(".log"))

    if not path.is_dir() or not all(start_file(p.name) for p in path.iterdir()):
        return False
    shutil.rmtree(path)
    try:
        path.parent.rmdir()  # fails, as it should, while other runs of this name are there
    except OSError:
        pass
    return True


def write_run_files(path: Path, config: Any) -> None:
    (path / "config.toml").write_text(dump_toml(config))
    (path / "version.json").write_text(json.dumps(code_version(), indent=2) + "\n")
    (path / "env.json").write_text(json.dumps(environment(), indent=2) + "\n")


class MetricsLog:
    """Appends JSON lines to ``metrics.jsonl`` (only rank 0 writes), and hands each record to
    the optional ``tensorboard`` sink."""

    def __init__(self, path: Path, enabled: bool = True, tensorboard: bool = False) -> None:
        self.path, self.enabled = path, enabled
        self.board = TensorBoardSink(path.parent / "tensorboard") if tensorboard and enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.board is not None:
            self.board.write(record)


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A record's numbers by path (``time_ms/forward``; a list's items ``peak_mem_mb/rank1``)."""
    out: dict[str, float] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(scalars(v, key + "/"))
        elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{key}/rank{i}": float(x) for i, x in enumerate(v)})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


class TensorBoardSink:
    """metrics.jsonl's train and eval records as TensorBoard scalars (``train/loss``,
    ``train/time_ms/forward``, ``valid/ndcg@10``, ``test/click/auc``) at their step, in
    ``RUN/tensorboard/``: ``tensorboard --logdir runs`` shows every run. Needs the
    ``tensorboard`` package (``pip install 'genrec[tensorboard]'``)."""

    SKIP = ("step", "epoch")

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            from genrec.config import ConfigError

            raise ConfigError("train.tensorboard = true needs the tensorboard package: "
                              "pip install 'genrec[tensorboard]'") from e
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind"), record.get("step")
        if kind not in ("train", "eval") or not isinstance(step, int):
            return
        group = "train" if kind == "train" else record.get("split", "eval")
        for key, value in scalars({k: v for k, v in record.items() if k not in self.SKIP}).items():
            self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()  # a killed job's curves are on disk up to its last record


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, out: Path, metric_keys: tuple[str, ...] = ("hr@10", "ndcg@10")) -> Path | None:
    """Training loss per step and validation metrics per epoch, as one PNG; None without
    matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval" and r.get("split") == "valid"]
    if not train and not evals:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    ax1.set(xlabel="step", ylabel="training loss", title="loss")
    ax1.grid(alpha=0.3)
    shown = [k for k in metric_keys if evals and k in evals[0]]
    shown += [k for k in (evals[0] if evals else {}) if k.endswith("/auc")]
    for k in shown:
        ax2.plot([r["epoch"] for r in evals], [r[k] for r in evals], marker="o", ms=3, label=k)
    ax2.set(xlabel="epoch", ylabel="validation", title="validation (full-corpus ranking)")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
