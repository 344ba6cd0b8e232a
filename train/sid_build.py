"""``genrec sid build``: a trained run's item vectors -> semantic IDs -> one file and its stats.

    checkpoint (run dir: its best) -> GenerativeRecommender -> item_embeddings(corpus_ids)
        -> build_semantic_ids (RQ-KMeans, models/sid.py) -> sid.safetensors + sid.json

The codebook and trie live in ``models/sid.py`` (serving imports them); this module only
loads a run, writes the files and prints what the codebook looks like.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from genrec.models.sid import SemanticIds, build_semantic_ids
from genrec.train.loop import checkpoint as ckpt

LOOKUP_ROWS = 1 << 16  # item rows looked up (and normalised) at a time


def load_item_vectors(run_dir: Path, checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's catalogue and its normalised item vectors: ids [N] (sorted), vectors [N, D]
    (what the retrieval head scores users against)."""
    from genrec.models.recommender import GenerativeRecommender
    from genrec.train.job import load_job

    job = load_job(run_dir / "config.toml")
    if job.model.arch != "generative":
        raise ckpt.IncompatibleCheckpoint(f"{run_dir}: arch '{job.model.arch}' has no item vectors to code; "
                                          "semantic IDs are built from a generative run")
    entry = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.get("model.corpus_ids")
    if entry is None:
        raise ckpt.IncompatibleCheckpoint(f"{checkpoint}: no model.corpus_ids (not a generative model's checkpoint)")
    # the buffer is filled by the load: the catalogue is the checkpoint's, no dataset needed
    model = GenerativeRecommender(job.model, job.embedding, torch.zeros(int(entry.size[0]), dtype=torch.long))
    ckpt.load_checkpoint(checkpoint, model, None)
    model.eval()
    ids = model.corpus_ids.clone()
    out = torch.empty(ids.numel(), model.item_embeddings(ids[:1]).shape[1])  # filled in blocks: no second copy
    with torch.no_grad():
        for i in range(0, ids.numel(), LOOKUP_ROWS):
            out[i : i + LOOKUP_ROWS] = model.item_embeddings(ids[i : i + LOOKUP_ROWS]).float()
    return ids, out


def output_path(out: str | Path | None, run_dir: Path) -> Path:
    """--out: a ``.safetensors`` file, or a directory (-> DIR/sid.safetensors); default the
    run directory."""
    path = Path(out) if out else run_dir
    return path if path.suffix == ".safetensors" else path / "sid.safetensors"


def write(sid: SemanticIds, path: Path, info: dict[str, Any]) -> Path:
    """``path`` (the codebook) and ``path`` with ``.json`` (stats, source, checksum) beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sid.save(path)
    manifest = {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                            for k, v in sid.state_dict().items()},
                "stats": sid.stats(), **info}
    meta = path.with_suffix(".json")
    meta.write_text(json.dumps(manifest, indent=2) + "\n")
    return meta


def format_stats(stats: dict[str, Any]) -> str:
    used = " ".join(f"{u:.0%}" for u in stats["used_per_level"])
    ppl = " ".join(f"{p:.0f}" for p in stats["perplexity_per_level"])
    return (f"{stats['items']} items, sizes {','.join(map(str, stats['sizes']))}, "
            f"collision rate {stats['collision_rate']:.2%}, max collisions {stats['max_collisions']}, "
            f"codes used per level {used}, perplexity {ppl}")


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"genrec sid build: --levels '{text}' must be positive integers, e.g. 256,256,256")
    return sizes


def cmd_sid(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise SystemExit(f"genrec sid {args.sid_cmd} takes no config overrides: {overrides}")
    sizes = parse_levels(args.levels)
    run_dir, checkpoint = ckpt.resolve_checkpoint(args.checkpoint)
    t0 = time.perf_counter()
    ids, vectors = load_item_vectors(run_dir, checkpoint)
    dim = int(vectors.shape[1])
    t1 = time.perf_counter()
    sid = build_semantic_ids(ids, vectors, sizes, iters=args.iters, seed=args.seed, balanced=args.balanced,
                             sample_per_centroid=args.sample_per_code, inplace=True)
    del vectors  # overwritten with the residuals
    t2 = time.perf_counter()
    path = output_path(args.out, run_dir)
    info = {"source": {"run_dir": str(run_dir), "checkpoint": checkpoint.name},
            "build": {"levels": list(sizes), "iters": args.iters, "seed": args.seed, "balanced": args.balanced,
                      "sample_per_code": args.sample_per_code, "dim": dim,
                      "load_seconds": round(t1 - t0, 3), "build_seconds": round(t2 - t1, 3),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}}
    meta = write(sid, path, info)
    print(f"wrote {path} and {meta.name} ({t2 - t1:.1f}s): {format_stats(sid.stats())}")
    return 0
