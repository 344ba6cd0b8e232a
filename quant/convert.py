"""Training checkpoint -> serving artifact (the artifact -> model direction is quant/load.py,
which serving imports without any training code).

``export`` loads a run's checkpoint into the unsharded model, measures it on the
validation split, writes the artifact (quantized tables + dense tensors), loads the
artifact back exactly as the server will, measures again, and records both in the
manifest's report: the deployer sees what the bytes cost. A model with a semantic-ID
decoder carries it and its codebook into dense.safetensors (``quant.dense``: kept as trained)
and says so in the manifest's ``generative``. Unless ``index = "none"``, the catalogue's ANN
index (quant/ann.py) is built from the served model's item vectors, its nprobe calibrated on the
validation users' vectors, and written into the artifact (index.safetensors, manifest ``index``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from tqdm import tqdm

from genrec.config import to_dict
from genrec.models.recommender import GenerativeRecommender
from genrec.models.sid import KEYS as SID_KEYS
from genrec.models.sid import SemanticIds
from genrec.quant.ann import IndexConfig, add_index
from genrec.quant.artifact import Manifest, save_artifact
from genrec.quant.dense import Scheme as DenseScheme
from genrec.quant.dense import dense_bytes, dense_tensors
from genrec.quant.embeddings import Scheme as EmbScheme
from genrec.quant.embeddings import check_dims, table_bytes, table_tensors
from genrec.quant.load import SID_PREFIX, load_model
from genrec.train.loop import checkpoint as ckpt
from genrec.train.loop.checkpoint import resolve_checkpoint  # noqa: F401 - re-exported (benchmarks, tests)
from genrec.train.runs.directory import code_version


@dataclass(frozen=True)
class QuantizeConfig:
    embeddings: EmbScheme = "int8"
    dense: DenseScheme = "fp32"
    row_alignment: int = 16  # bytes each served row is padded to in memory (fbgemm TBE)
    index: IndexConfig = IndexConfig()  # the catalogue's ANN index; factory "none": exact search only


def _corpus_size(checkpoint: Path) -> int:
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    entry = meta.state_dict_metadata.get("model.corpus_ids")
    if entry is None:
        raise ValueError(f"{checkpoint}: no model.corpus_ids; only generative retrieval/ranking models are served")
    return int(entry.size[0])


def checkpoint_semantic_ids(checkpoint: Path) -> SemanticIds:
    """The codebook a decoder was trained with, read from the checkpoint itself (its
    ``sid_head.book_*`` buffers): no codebook file needs to travel with the run."""
    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    keys = {k: f"model.{SID_PREFIX}{k}" for k in SID_KEYS}
    missing = [v for v in keys.values() if v not in stored]
    if missing:
        raise ValueError(f"{checkpoint}: the config has model.sid.enabled but the checkpoint has no '{missing[0]}'")
    book = {v: torch.empty(list(stored[v].size), dtype=stored[v].properties.dtype) for v in keys.values()}
    dcp.load(book, checkpoint_id=str(checkpoint))
    return SemanticIds.from_state_dict({k: book[v] for k, v in keys.items()})


def load_training_model(run_dir: Path, checkpoint: Path) -> tuple[Any, GenerativeRecommender]:
    from genrec.train.job import load_job

    job = load_job(run_dir / "config.toml")
    if job.model.arch != "generative":
        raise ValueError(f"{run_dir}: arch '{job.model.arch}' is a baseline; the serving tier serves generative models")
    sid = checkpoint_semantic_ids(checkpoint) if job.model.sid.enabled else None
    model = GenerativeRecommender(job.model, job.embedding, torch.zeros(_corpus_size(checkpoint), dtype=torch.long),
                                  sid=sid)
    ckpt.load_checkpoint(checkpoint, model, None)
    return job, model.eval()


def export(
    checkpoint: str | Path,
    out: str | Path,
    qcfg: QuantizeConfig,
    eval_data: str | Path | None = None,
    progress: bool = True,
    measure_accuracy: bool = True,
) -> dict[str, Any]:
    """Writes the artifact and returns the report (sizes and accuracy before / after)."""
    from genrec.train.data.reader import make_reader
    from genrec.train.eval.evaluate import evaluate
    from genrec.train.observe.logs import progress as batches_with_progress

    bar = tqdm(total=6, desc="quantize", disable=not progress, unit="step")
    run_dir, ckpt_dir = resolve_checkpoint(checkpoint)
    job, model = load_training_model(run_dir, ckpt_dir)
    check_dims({t.name: t.dim for t in job.embedding.tables}, qcfg.embeddings)  # before any evaluation
    bar.update(1)
    data = Path(eval_data) if eval_data else Path(job.data.path)
    have_data = measure_accuracy and (data / "dataset.json").exists()

    def measure(m: torch.nn.Module, name: str) -> dict[str, float] | None:
        if not have_data:
            return None
        reader = make_reader(job.data.__class__(**{**job.data.__dict__, "path": str(data)}), "valid",
                             job.embedding, job.model.max_seq_len)
        return evaluate(m, batches_with_progress(reader, f"valid, {name}", enabled=progress), job.eval)

    t0 = time.perf_counter()
    before = measure(model, "checkpoint")
    bar.update(1)
    emb_float = sum(p.numel() * p.element_size() for p in model.sparse.parameters())
    emb = table_tensors(model.sparse, qcfg.embeddings)
    dense = dense_tensors(model, qcfg.dense)
    # the catalogue and the codebook are ids, not weights: counted apart from the dense weights
    index = ["corpus_ids", *(SID_PREFIX + k for k in SID_KEYS if SID_PREFIX + k in dense)]
    index_bytes = dense_bytes({k: dense[k] for k in index})
    dense_float = dense_bytes(dense_tensors(model, "fp32")) - index_bytes
    manifest = Manifest(
        model=to_dict(job.model), embedding=to_dict(job.embedding),
        quantization={"embeddings": qcfg.embeddings, "dense": qcfg.dense, "row_alignment": qcfg.row_alignment},
        source={"run_dir": str(run_dir), "checkpoint": ckpt_dir.name, "code_version": code_version(),
                "dataset": job.data.path},
        generative=generative_info(model),
    )
    save_artifact(out, manifest, {"embeddings.safetensors": emb, "dense.safetensors": dense})
    bar.update(1)
    served, manifest = load_model(out)
    bar.update(1)
    after = measure(served, "artifact")
    bar.update(1)
    if qcfg.index.factory != "none":
        queries = valid_users(served, job, data) if (data / "dataset.json").exists() else None
        add_index(out, served, manifest, qcfg.index, queries)
    bar.update(1)
    bar.close()
    report = {
        "sizes": {
            "embeddings": {"before": emb_float, "after": table_bytes(emb), "scheme": qcfg.embeddings},
            "dense": {"before": dense_float, "after": dense_bytes(dense) - index_bytes, "scheme": qcfg.dense},
            "catalogue": {"items": int(dense["corpus_ids"].numel()), "bytes": dense["corpus_ids"].numel() * 8},
            "codebook": {"bytes": index_bytes - dense["corpus_ids"].numel() * 8},
            "files": {k: v["bytes"] for k, v in manifest.files.items()},
        },
        "index": {k: v for k, v in manifest.index.items() if k != "table"},
        "metrics": {"split": "valid", "data": str(data), "before": before, "after": after},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    manifest.report = report
    (Path(out) / "manifest.json").write_text(json.dumps(manifest.__dict__, indent=2) + "\n")
    return report


def valid_users(model: GenerativeRecommender, job: Any, data: Path, n: int = 1024) -> Any:
    """[<= n, D] float32 numpy: the served model's vectors of the first ``n`` validation users
    (the queries the index's nprobe is calibrated on)."""
    from genrec.train.data.reader import make_reader

    reader = make_reader(job.data.__class__(**{**job.data.__dict__, "path": str(data)}), "valid", job.embedding,
                         job.model.max_seq_len)
    out, got = [], 0
    with torch.inference_mode():
        for batch in reader:
            out.append(model.user_embeddings(batch).float())
            got += out[-1].shape[0]
            if got >= n:
                break
    return torch.cat(out)[:n].numpy()


def generative_info(model: GenerativeRecommender) -> dict[str, Any]:
    """The manifest's ``generative``: {} without a semantic-ID decoder, else what serving
    reports of it (ModelInfo): levels, codes per level, coded items, the default beam."""
    head = model.sid_head
    if head is None:
        return {}
    return {"levels": head.levels, "sizes": list(head.sizes), "items": int(head.sid.item_ids.numel()),
            "beam_width": model.cfg.sid.beam_width}


def format_report(report: dict[str, Any]) -> str:
    s = report["sizes"]
    lines = ["| component | before | after | ratio |", "|---|---|---|---|"]
    for name in ("embeddings", "dense"):
        b, a = s[name]["before"], s[name]["after"]
        lines.append(f"| {name} (fp32 -> {s[name]['scheme']}) | {b / 1e6:.2f} MB | {a / 1e6:.2f} MB | {a / b:.3f}x |")
    tb = s["embeddings"]["before"] + s["dense"]["before"]
    ta = s["embeddings"]["after"] + s["dense"]["after"]
    lines.append(f"| total | {tb / 1e6:.2f} MB | {ta / 1e6:.2f} MB | {ta / tb:.3f}x |")
    m = report["metrics"]
    if m["before"] and m["after"]:
        lines += ["", f"| metric ({m['split']}) | before | after | change |", "|---|---|---|---|"]
        for k in ("hr@10", "ndcg@10", "hr@50", "mrr"):
            b, a = m["before"][k], m["after"][k]
            change = f"{100 * (a - b) / b:+.2f}%" if b else f"{a - b:+.4f} (absolute)"
            lines.append(f"| {k} | {b:.4f} | {a:.4f} | {change} |")
    else:
        lines.append("\n(accuracy not measured: --no-eval, or no dataset at hand; pass --eval DATA)")
    return "\n".join(lines)
