"""The approximate-nearest-neighbour index of an artifact's catalogue (faiss), built at quantize.

    served model --item_vectors--> [N, D] --build_index--> faiss IVF index (positions 0..N-1)
    --write_index--> ARTIFACT/index.safetensors (the serialized index as one uint8 tensor) and
                     the manifest's ``index`` (factory, nprobe, shortlist, the table it indexes)

The index answers a shortlist (``shortlist`` positions per query, by its approximate inner
product); serving re-scores the shortlist exactly against the fp32 item vectors
(serve.catalogue), so the index's codes only choose candidates, never the returned scores.

Why IVF with 4-bit fast-scan product quantization (``IVF{nlist},PQ{D/2}x4fs``): it keeps an
item in D/4 bytes of codes plus an 8-byte id (0.09x the fp32 row at D = 64), scans codes with
SIMD lookups, and, with the exact re-score, reaches recall@100 >= 0.95 of exact search at a
few percent of the lists probed (benchmarks/ann_index.py measures it against HNSW and SQ8).
HNSW keeps the full vectors plus a graph: more memory than the table itself.

The manifest records the table the index was built from (items, dimension, the sha256 of
``corpus_ids`` and of embeddings.safetensors): :func:`load_index` refuses an index whose table
is not the artifact's, naming both. ``nprobe`` is calibrated at build on validation queries
(the users of the run's validation split where the data is at hand): the smallest of a ladder
whose recall@``k`` against exact search reaches ``target``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genrec.quant.artifact import (
    ArtifactError,
    Manifest,
    _regular_file,
    file_sha256,
    tensor_sha256,
    whole,
)

INDEX_FILE = "index.safetensors"
NPROBE_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class IndexConfig:
    """``genrec quantize``'s index options. ``factory``: "auto" (IVF-PQ fast scan sized by the
    catalogue, :func:`auto_factory`), "none" (no index: exact search only), or a faiss
    index_factory string. ``shortlist``: candidates per query handed to the exact re-score (the
    shortest :func:`calibrate` tries);
    ``target``: the recall@``k`` against exact search that ``nprobe`` is calibrated to."""

    factory: str = "auto"
    shortlist: int = 1000
    target: float = 0.97
    k: int = 100
    train_points: int = 262144  # k-means sample (at least 40 points per IVF list)
    seed: int = 0


def auto_factory(n: int, dim: int) -> str:
    """IVF lists ~ 2 sqrt(N) (a power of two, >= 1, <= N / 39 so k-means has its 39 points per
    list), PQ with D/2 sub-quantizers of 4 bits (2 dims each)."""
    nlist = 2 ** round(math.log2(max(2 * math.sqrt(n), 1)))
    nlist = max(1, min(nlist, 2 ** int(math.log2(max(n // 39, 1)))))
    m = max(dim // 2, 1)
    return f"IVF{nlist},PQ{m}x4fs"


def item_vectors(model: torch.nn.Module, chunk: int = 65536) -> torch.Tensor:
    """The served model's normalised item vectors [N, D] in catalogue order (``corpus_ids``):
    what serving scores and what the index is built from."""
    with torch.inference_mode():
        corpus = model.corpus_ids
        return torch.cat([model.item_embeddings(corpus[i : i + chunk]) for i in range(0, corpus.numel(), chunk)])


def build_index(vectors: np.ndarray, factory: str, train_points: int = 262144, seed: int = 0) -> Any:
    """A trained faiss index (inner product) over ``vectors`` [N, D] float32, ids = positions."""
    import faiss

    n, dim = vectors.shape
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if hasattr(index, "implem") and hasattr(index, "by_residual"):
        # an IVF fast-scan index codes each vector's offset from its list's centroid, not the
        # vector: faiss turns that off for fast scan by default (cheaper under L2), but for inner
        # products a list's look-up table only gains a constant, and the codes are finer. At
        # 10^7 items (IVF8192,PQ32x4fs, validation users) recall@100 against exact at nprobe
        # 512 rose from 0.928 to 0.954 with 2,000 re-scored, 0.961 to 0.972 with 4,000
        index.by_residual = True
    try:  # k-means wants 39+ points a list: below that faiss warns, and its centroids are poorer
        train_points = max(train_points, 40 * faiss.extract_index_ivf(index).nlist)
    except RuntimeError:  # (not an IVF index)
        pass
    rng = np.random.default_rng(seed)
    sample = vectors if n <= train_points else vectors[np.sort(rng.choice(n, train_points, replace=False))]
    index.train(np.ascontiguousarray(sample, np.float32))
    for i in range(0, n, 1 << 20):
        index.add(np.ascontiguousarray(vectors[i : i + (1 << 20)], np.float32))
    return index


def set_nprobe(index: Any, nprobe: int) -> None:
    """Lists probed per query (IVF), or the search breadth (HNSW efSearch)."""
    import faiss

    if hasattr(index, "nprobe") or "IVF" in type(index).__name__:
        faiss.extract_index_ivf(index).nprobe = nprobe
    elif hasattr(index, "hnsw"):
        index.hnsw.efSearch = nprobe


def blockwise_top(scores: Callable[[int, int], torch.Tensor], n: int, k: int, chunk: int) -> torch.Tensor:
    """[Q, k] positions in 0..n-1 of the top-k of ``scores(start, end)`` ([Q, end - start], the
    block's scores), best first, block by block: each block's top-k merged into a running one,
    the same list as one top-k over [Q, n] (ties aside) in O(Q x chunk) memory."""
    best_v = best_i = None
    for i in range(0, max(n, 1), chunk):  # (an empty catalogue: one empty block, [Q, 0])
        s = scores(i, min(i + chunk, n))
        v, j = torch.topk(s, min(k, s.shape[1]), dim=1)
        if best_v is None or best_i is None:
            best_v, best_i = v, j + i
            continue
        best_v, at = torch.topk(torch.cat([best_v, v], 1), min(k, best_v.shape[1] + v.shape[1]), dim=1)
        best_i = torch.gather(torch.cat([best_i, j + i], 1), 1, at)
    assert best_i is not None
    return best_i


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int, chunk: int = 262144) -> np.ndarray:
    """[Q, k] positions of the exact top-k inner products (the reference recall is measured to)."""
    q = torch.from_numpy(np.ascontiguousarray(queries, np.float32))
    return blockwise_top(lambda s, e: q @ torch.from_numpy(vectors[s:e]).float().t(), vectors.shape[0], k, chunk).numpy()


def ann_top(index: Any, vectors: np.ndarray, queries: np.ndarray, k: int, shortlist: int) -> np.ndarray:
    """[Q, k] positions: the index's ``shortlist`` re-scored exactly against ``vectors``, best
    first (-1 where the index found fewer). The same re-score serving runs."""
    _, pos = index.search(np.ascontiguousarray(queries, np.float32), max(shortlist, k))
    safe = np.maximum(pos, 0)
    s = np.einsum("qd,qsd->qs", queries.astype(np.float32), vectors[safe].astype(np.float32))
    s[pos < 0] = -np.inf
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.where(np.take_along_axis(s, order, 1) > -np.inf, np.take_along_axis(pos, order, 1), -1)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of |found ∩ truth| / |truth| (both [Q, k] positions)."""
    return float(np.mean([np.intersect1d(f[f >= 0], t).size / t.size for f, t in zip(found, truth)]))


def calibrate(index: Any, vectors: np.ndarray, queries: np.ndarray, cfg: IndexConfig,
              ) -> tuple[int, int, dict[str, dict[str, float]]]:
    """(nprobe, shortlist, recall per shortlist and nprobe tried): for shortlists ``cfg.shortlist``,
    2x, 4x and 8x that, the smallest nprobe of NPROBE_LADDER whose recall@k of the re-scored
    shortlist against exact search on ``queries`` reaches ``cfg.target``; the first shortlist
    that reaches it wins (a longer shortlist only pays where the codes rank the true neighbours
    too low: recall that stops growing with nprobe). None reaching it: the best pair tried."""
    import faiss

    nlist = faiss.extract_index_ivf(index).nlist
    truth = exact_top(vectors, queries, cfg.k)
    tried: dict[str, dict[str, float]] = {}
    best = (-1.0, 1, cfg.shortlist)
    ladder = [p for p in NPROBE_LADDER if p < nlist] + [nlist]
    for shortlist in (cfg.shortlist * m for m in (1, 2, 4, 8)):
        row: dict[str, float] = {}
        tried[str(shortlist)] = row
        for p in ladder:
            set_nprobe(index, p)
            row[str(p)] = r = round(recall(ann_top(index, vectors, queries, cfg.k, shortlist), truth), 4)
            best = max(best, (r, -p, shortlist), key=lambda b: (b[0], b[1]))
            if r >= cfg.target:
                return p, shortlist, tried
            seen = list(row.values())
            if len(seen) >= 3 and seen[-1] - seen[-3] < 0.002:  # saturated: the codes, not the lists
                break
    return -best[1], best[2], tried


def table_of(manifest: Manifest) -> dict[str, Any]:
    """What identifies the table an index is built from: items, the sha256 of ``corpus_ids``
    and of embeddings.safetensors (as the artifact's manifest lists them)."""
    corpus = manifest.tensors.get("dense.safetensors", {}).get("corpus_ids", {})
    return {"items": int(corpus.get("shape", [0])[0]), "corpus_sha256": corpus.get("sha256"),
            "embeddings_sha256": manifest.files.get("embeddings.safetensors", {}).get("sha256")}


def write_index(out: Path, manifest: Manifest, index: Any, dim: int, info: dict[str, Any]) -> None:
    """Writes ``index`` to ``out``/index.safetensors and lists it (file and tensor sha256, size)
    and its ``index`` entry (``info`` + dimension + the table it was built from) in ``manifest``
    (the caller writes the manifest)."""
    import faiss
    from safetensors.torch import save_file

    blob = torch.from_numpy(faiss.serialize_index(index))
    save_file({"faiss": blob}, str(out / INDEX_FILE))
    manifest.tensors[INDEX_FILE] = {"faiss": {"dtype": "uint8", "shape": list(blob.shape), "sha256": tensor_sha256(blob)}}
    manifest.files[INDEX_FILE] = {"sha256": file_sha256(out / INDEX_FILE), "bytes": (out / INDEX_FILE).stat().st_size}
    manifest.index = {**info, "file": INDEX_FILE, "items": int(index.ntotal), "dim": dim, "bytes": int(blob.numel()),
                      "table": table_of(manifest)}


# faiss's fast-scan search for one query: int16 distances into a reservoir (implem 11) rather
# than its automatic choice (a heap), which serves a lone query's shortlist of thousands 15%
# slower (10^7 items, nprobe 512, 4,200 kept: 3.4 against 4.0 ms, the same distances); from a
# few queries on, the automatic choice batches them (query blocks) and is the faster one
LONE_QUERY_IMPLEM = 11


@dataclass
class AnnIndex:
    """A loaded index: the faiss object, its manifest entry, nprobe and shortlist in force."""

    index: Any
    info: dict[str, Any]
    nprobe: int
    shortlist: int

    def search(self, queries: np.ndarray, n: int) -> np.ndarray:
        """[Q, n] catalogue positions, approximately best first (-1: none), for ``queries`` [Q, D]."""
        if hasattr(self.index, "implem"):  # an IVF fast-scan index: see LONE_QUERY_IMPLEM
            self.index.implem = LONE_QUERY_IMPLEM if len(queries) == 1 else 0
        return self.index.search(np.ascontiguousarray(queries, np.float32), n)[1]

    @property
    def describe(self) -> str:
        return describe(self.info, self.nprobe, self.shortlist)


def describe(info: dict[str, Any], nprobe: int = 0, shortlist: int = 0) -> str:
    """How an index search is reported (ModelInfo.dense_search): "ann <factory> nprobe=.. shortlist=.."."""
    return (f"ann {info.get('factory')} nprobe={nprobe or info.get('nprobe')} "
            f"shortlist={shortlist or info.get('shortlist')}")


def _mismatch(path: Path, built: dict[str, Any], have: dict[str, Any]) -> str:
    def table(t: dict[str, Any]) -> str:
        return (f"{t.get('items')} items x {t.get('dim')} dims (corpus_ids sha256 {str(t.get('corpus_sha256'))[:12]}, "
                f"embeddings.safetensors sha256 {str(t.get('embeddings_sha256'))[:12]})")

    return (f"{path / INDEX_FILE}: the index was built for a table of {table(built)}, but this artifact's table has "
            f"{table(have)}; rebuild it with 'genrec quantize' (or serve with serve.retrieval.search = \"exact\")")


def load_index(path: str | Path, manifest: Manifest, dim: int, nprobe: int = 0, shortlist: int = 0) -> AnnIndex:
    """The artifact's index, verified: the file's and the tensor's sha256 as the manifest lists
    them, and the table it was built from (items, dimension ``dim`` of the served vectors,
    corpus and embeddings checksums) the artifact's own; refused naming both otherwise.
    ``nprobe`` / ``shortlist``: 0 keeps the manifest's."""
    import faiss
    from safetensors.torch import load_file

    path = Path(path)
    info = manifest.index
    if not info or INDEX_FILE not in manifest.files:
        raise ArtifactError(f"{path}: the artifact has no index; build one with 'genrec quantize' (--index auto), "
                            "or serve with serve.retrieval.search = \"exact\"")
    meta = manifest.files[INDEX_FILE]
    size = _regular_file(path / INDEX_FILE, INDEX_FILE)
    if size != meta.get("bytes") or file_sha256(path / INDEX_FILE) != meta.get("sha256"):
        raise ArtifactError(f"{path / INDEX_FILE}: checksum mismatch: the file was changed after export")
    blob = load_file(str(path / INDEX_FILE)).get("faiss")
    want = manifest.tensors.get(INDEX_FILE, {}).get("faiss", {})
    if blob is None or blob.dtype != torch.uint8 or tensor_sha256(blob) != want.get("sha256"):
        raise ArtifactError(f"{path / INDEX_FILE}: tensor 'faiss' is missing or does not match its checksum")
    built = {**info.get("table", {}), "dim": info.get("dim")}
    have = {**table_of(manifest), "dim": dim}
    if built != have:
        raise ArtifactError(_mismatch(path, built, have))
    index = faiss.deserialize_index(blob.numpy())
    if index.ntotal != have["items"] or index.d != dim:
        raise ArtifactError(_mismatch(path, {**built, "items": int(index.ntotal), "dim": int(index.d)}, have))
    for key in ("nprobe", "shortlist"):
        value = info.get(key, 1)
        if not whole(value, 1):
            raise ArtifactError(f"{path}/manifest.json: index.{key} = {value!r}; it must be a positive integer")
    ann = AnnIndex(index, info, nprobe or int(info.get("nprobe", 1)), shortlist or int(info.get("shortlist", 1000)))
    set_nprobe(index, ann.nprobe)
    # faiss's OpenMP pool (its own runtime) as wide as torch's: the engine process's threads
    # (serve.process.threads), not every core of the machine
    faiss.omp_set_num_threads(torch.get_num_threads())
    return ann


def add_index(out: str | Path, model: torch.nn.Module, manifest: Manifest, cfg: IndexConfig,
              queries: np.ndarray | None = None, source: str = "valid users") -> dict[str, Any]:
    """Builds the index of the served ``model`` (loaded from the artifact at ``out``), calibrates
    nprobe on ``queries`` [Q, D] (validation users; None: 256 catalogue items' own vectors),
    writes it into the artifact (``manifest`` updated; the caller writes it) and returns the
    manifest's ``index`` entry. ``source``: what ``queries`` are, as the manifest records it."""
    out = Path(out)
    vectors = item_vectors(model).float().numpy()
    n, dim = vectors.shape
    factory = auto_factory(n, dim) if cfg.factory == "auto" else cfg.factory
    t0 = time.perf_counter()
    index = build_index(vectors, factory, cfg.train_points, cfg.seed)
    build_s = time.perf_counter() - t0
    if queries is None:
        rng = np.random.default_rng(cfg.seed + 1)
        queries, source = vectors[rng.choice(n, min(256, n), replace=False)], "catalogue items"
    nprobe, shortlist, tried = calibrate(index, vectors, queries, cfg)
    info = {"factory": factory, "metric": "inner_product", "nprobe": nprobe, "shortlist": shortlist,
            "calibration": {"queries": source, "n": int(queries.shape[0]), "k": cfg.k, "target": cfg.target,
                            "recall_by_shortlist_nprobe": tried},
            "build_seconds": round(build_s, 2)}
    write_index(out, manifest, index, dim, info)
    return manifest.index


def index_artifact(path: str | Path, cfg: IndexConfig, queries: np.ndarray | None = None,
                   source: str = "valid users") -> dict[str, Any]:
    """:func:`add_index` for the artifact at ``path`` as it stands (its model loaded as serving
    loads it), the manifest rewritten: the index entry it got."""
    import json

    from genrec.quant.load import load_model

    model, manifest = load_model(path)
    info = add_index(path, model, manifest, cfg, queries, source)
    (Path(path) / "manifest.json").write_text(json.dumps(manifest.__dict__, indent=2) + "\n")
    return info
