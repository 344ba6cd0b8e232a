"""The catalogue's ANN index (quant/ann.py, serve/catalogue.py): built into the artifact, listed
and hashed, loaded by the engine, the shortlist re-scored exactly, exact search by config, and an
index that does not match the artifact's table refused at load."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from genrec.proto.v1 import recommender_pb2 as pb
from genrec.quant.ann import INDEX_FILE, IndexConfig, index_artifact, item_vectors
from genrec.quant.artifact import (
    ArtifactError,
    check_artifact,
    file_sha256,
    read_manifest,
    tensor_sha256,
)
from genrec.quant.load import load_model
from genrec.serve.ann import RetrievalConfig
from genrec.serve.catalogue import Catalogue, read_served
from genrec.serve.engine import TorchEngine
from tests.serving_helpers import ThreadedServer, local_config, untrained_artifact

ITEMS = 3000


@dataclass
class Ask:
    retrieve_k: int
    seen: np.ndarray | None = None

    def excluded(self) -> np.ndarray | None:
        return self.seen


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    art = untrained_artifact(tmp_path_factory.mktemp("ann") / "art", ranking=False, items=ITEMS)
    index_artifact(art, IndexConfig(factory="IVF16,PQ8x4fs", shortlist=200, target=0.95, k=50))
    return art


def _users(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    u = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.normalize(u, dim=1)


def test_the_index_is_listed_hashed_and_described_in_the_manifest(indexed):
    m = check_artifact(indexed)
    assert m.files[INDEX_FILE]["sha256"] == file_sha256(indexed / INDEX_FILE)
    blob = load_file(str(indexed / INDEX_FILE))["faiss"]
    assert m.tensors[INDEX_FILE]["faiss"]["sha256"] == tensor_sha256(blob)
    assert m.index["items"] == ITEMS and m.index["dim"] == 16 and m.index["factory"] == "IVF16,PQ8x4fs"
    assert m.index["table"]["items"] == ITEMS and 1 <= m.index["nprobe"] <= 16
    tried = m.index["calibration"]["recall_by_shortlist_nprobe"]
    assert tried[str(m.index["shortlist"])][str(m.index["nprobe"])] >= 0.95 or m.index["nprobe"] == 16


def test_fast_scan_codes_residuals_and_lone_queries_use_a_reservoir(indexed):
    """An IVF fast-scan index codes each vector's offset from its centroid (finer codes for inner
    products: faiss's default for fast scan leaves it off), and a lone query's search keeps its
    shortlist in a reservoir, a batch in faiss's default; both give the same distances."""
    from genrec.quant.ann import LONE_QUERY_IMPLEM, load_index

    model, manifest = load_model(indexed)
    ann = load_index(indexed, manifest, 16, nprobe=4, shortlist=200)
    assert ann.index.by_residual
    users = _users(3, 16).numpy()
    lone = np.concatenate([ann.search(users[i : i + 1], 200) for i in range(3)])
    assert ann.index.implem == LONE_QUERY_IMPLEM
    batch = ann.search(users, 200)
    assert ann.index.implem == 0
    assert np.mean([len(set(a) & set(b)) / 200 for a, b in zip(lone, batch)]) > 0.99  # (ties at the cut)


def test_ann_search_with_every_list_probed_equals_exact_search(indexed):
    model, manifest = load_model(indexed)
    exact = Catalogue(model, None, indexed, manifest, RetrievalConfig(search="exact"))
    full = Catalogue(model, None, indexed, manifest, RetrievalConfig(search="ann", nprobe=16, shortlist=ITEMS))
    assert exact.ann is None and exact.search == "exact" and full.search.startswith("ann IVF16,PQ8x4fs nprobe=16")
    users = _users(8, 16)
    seen = exact.ids[np.random.default_rng(0).choice(ITEMS, 40, replace=False)]
    works = [(i, Ask(50, seen if i % 2 else None)) for i in range(8)]
    a, b = exact.top_k(users, works), full.top_k(users, works)
    for i in range(8):
        np.testing.assert_array_equal(a[i][0], b[i][0])
        np.testing.assert_allclose(a[i][1], b[i][1], rtol=1e-5, atol=1e-5)
        if i % 2:
            assert not np.isin(b[i][0], seen).any() and b[i][0].size == 50


def test_calibrated_ann_search_keeps_the_recall_it_was_built_for(indexed):
    model, manifest = load_model(indexed)
    exact = Catalogue(model, None, indexed, manifest, RetrievalConfig(search="exact"))
    ann = Catalogue(model, None, indexed, manifest)  # auto: the index, its calibrated nprobe
    assert ann.ann is not None and ann.vectors_t is None and exact.vectors_t is not None  # one layout each
    vectors = item_vectors(model)
    users = torch.nn.functional.normalize(vectors[:64] + 0.3 * _users(64, 16, 1), dim=1)  # near the items
    works = [(i, Ask(50)) for i in range(64)]
    a, b = exact.top_k(users, works), ann.top_k(users, works)
    rec = np.mean([np.intersect1d(a[i][0], b[i][0]).size / 50 for i in range(64)])
    assert rec >= 0.85
    for i in range(64):  # re-scored exactly: every score the index returns is the exact one
        pos = np.searchsorted(exact.ids, b[i][0])
        want = (users[i] @ vectors[pos].T / exact.temperature).numpy()
        np.testing.assert_allclose(b[i][1], want, rtol=1e-5, atol=1e-5)


def test_the_engine_and_model_info_say_which_search_answers(indexed):
    eng = TorchEngine(indexed)
    assert eng.schema.dense_search.startswith("ann IVF16,PQ8x4fs")
    assert TorchEngine(indexed, retrieval=RetrievalConfig(search="exact")).schema.dense_search == "exact"
    assert read_served(indexed).schema.dense_search.startswith("ann IVF16")  # the SGLang front end's
    srv = ThreadedServer(indexed, local_config())
    try:
        c = srv.client(timeout_s=30.0)
        assert c.info().dense_search == eng.schema.dense_search
        user = pb.User(history=[pb.Event(item_id=5, timestamp=1_700_000_000)])
        assert len(c.retrieve(user, k=20).items) == 20
        assert srv.server.engine.stages["retrieve_ann"] > 0  # the metric of which search answered
    finally:
        srv.stop()


def test_search_ann_without_an_index_is_refused_naming_the_fix(tmp_path):
    art = untrained_artifact(tmp_path / "plain", ranking=False, items=200)
    with pytest.raises(ArtifactError, match="genrec quantize"):
        TorchEngine(art, retrieval=RetrievalConfig(search="ann"))
    assert TorchEngine(art).schema.dense_search == "exact"  # auto: exact where there is no index


def _graft(index_from: Path, into: Path) -> None:
    """Copies ``index_from``'s index file and its manifest entries into ``into`` (an index
    carried over from another artifact)."""
    src, dst = read_manifest(index_from), json.loads((into / "manifest.json").read_text())
    shutil.copy(index_from / INDEX_FILE, into / INDEX_FILE)
    dst["files"][INDEX_FILE], dst["tensors"][INDEX_FILE] = src.files[INDEX_FILE], src.tensors[INDEX_FILE]
    dst["index"] = src.index
    (into / "manifest.json").write_text(json.dumps(dst))


def test_an_index_of_another_catalogue_size_is_refused_naming_both(indexed, tmp_path):
    other = untrained_artifact(tmp_path / "other", ranking=False, items=ITEMS + 500)
    _graft(indexed, other)
    with pytest.raises(ArtifactError, match=rf"built for a table of {ITEMS} items x 16 dims.*has {ITEMS + 500} items x 16"):
        TorchEngine(other)
    TorchEngine(other, retrieval=RetrievalConfig(search="exact"))  # the named way out


def test_an_index_of_another_table_of_the_same_size_is_refused_naming_both_checksums(indexed, tmp_path):
    other = tmp_path / "retrained"
    shutil.copytree(indexed, other)
    emb = load_file(str(other / "embeddings.safetensors"))  # the table re-exported: other values
    emb = {k: v + 0.01 if v.is_floating_point() else v for k, v in emb.items()}
    save_file(emb, str(other / "embeddings.safetensors"))
    m = json.loads((other / "manifest.json").read_text())
    m["files"]["embeddings.safetensors"] = {"sha256": file_sha256(other / "embeddings.safetensors"),
                                            "bytes": (other / "embeddings.safetensors").stat().st_size}
    m["tensors"]["embeddings.safetensors"] = {k: {**m["tensors"]["embeddings.safetensors"][k],
                                                  "sha256": tensor_sha256(v)} for k, v in emb.items()}
    (other / "manifest.json").write_text(json.dumps(m))
    old = read_manifest(indexed).files["embeddings.safetensors"]["sha256"][:12]
    new = m["files"]["embeddings.safetensors"]["sha256"][:12]
    with pytest.raises(ArtifactError, match=rf"embeddings.safetensors sha256 {old}.*embeddings.safetensors sha256 {new}"):
        TorchEngine(other)


def test_a_changed_index_file_is_refused(indexed, tmp_path):
    other = tmp_path / "tampered"
    shutil.copytree(indexed, other)
    raw = bytearray((other / INDEX_FILE).read_bytes())
    raw[-5] ^= 0xFF
    (other / INDEX_FILE).write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        TorchEngine(other)


def test_the_index_search_settings_are_part_of_the_version_and_checked(indexed, tmp_path):
    """nprobe and shortlist change what ANN retrieval returns: a manifest edited in them alone is
    another model_version (replicas and standbys compare it), and values that cannot search are
    refused."""
    ann = RetrievalConfig(search="ann")
    other = tmp_path / "probes"
    shutil.copytree(indexed, other)
    m = json.loads((other / "manifest.json").read_text())
    m["index"]["nprobe"] = 1
    (other / "manifest.json").write_text(json.dumps(m))
    assert read_served(other, ann).version != read_served(indexed, ann).version
    for bad in (0, -3, "4", True):
        m["index"]["nprobe"] = bad
        (other / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(ArtifactError, match="index.nprobe"):
            TorchEngine(other, retrieval=ann)


def test_shortlist_best_k_is_the_full_sort_and_exclusion_is_membership() -> None:
    """The re-score keeps each row's k best by a partition and a sort of those k: the same ids and
    scores, in the same order, as a stable sort of the whole shortlist (masked entries included);
    exclusion by binary search marks exactly np.isin's items."""
    from genrec.serve.catalogue import _among, _best

    rng = np.random.default_rng(0)
    items = rng.integers(1, 10**7, size=(3, 500))
    scores = rng.standard_normal((3, 500)).astype(np.float32)
    scores[0, rng.choice(500, 480, replace=False)] = -np.inf  # fewer than k left: masked ones come last
    for k in (1, 100, 500):
        got_ids, got_vals = _best(items, scores, k)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(got_vals, np.take_along_axis(scores, order, 1))
        kept = np.take_along_axis(scores, order, 1) > -np.inf  # (which masked item fills a slot is moot)
        np.testing.assert_array_equal(got_ids[kept], np.take_along_axis(items, order, 1)[kept])
    history = np.unique(np.concatenate([items[1, ::7], rng.integers(1, 10**7, 50)]))
    np.testing.assert_array_equal(_among(items[1], history), np.isin(items[1], history))
    assert not _among(items[1], np.zeros(0, np.int64)).any()


def test_what_a_front_end_reads_reports_the_configured_search(indexed, tmp_path):
    """read_served (the SGLang engine's front end) reports the search [serve.retrieval] asks for,
    as the torch engine's catalogue does, and refuses "ann" on an artifact without an index."""
    assert read_served(indexed, RetrievalConfig(search="exact")).schema.dense_search == "exact"
    got = read_served(indexed, RetrievalConfig(search="ann", nprobe=3, shortlist=77)).schema.dense_search
    assert got == "ann IVF16,PQ8x4fs nprobe=3 shortlist=77"
    model, manifest = load_model(indexed)
    cat = Catalogue(model, None, indexed, manifest, RetrievalConfig(search="ann", nprobe=3, shortlist=77))
    assert cat.search == got and read_served(indexed).schema.dense_search.startswith("ann IVF16,PQ8x4fs nprobe=")
    bare = untrained_artifact(tmp_path / "bare", ranking=False, items=200)
    with pytest.raises(ArtifactError, match="no index"):
        read_served(bare, RetrievalConfig(search="ann"))
