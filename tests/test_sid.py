"""Semantic IDs (models/sid.py): the item <-> code maps, the trie a constrained beam walks,
RQ-KMeans, the file, and ``genrec sid build`` on a tiny trained run."""

import json
import sys

import pytest
import torch

from genrec.models.sid import SemanticIdError, SemanticIds, build_semantic_ids, kmeans, rq_kmeans
from tests.conftest import tiny_job_overrides


def catalogue(n: int = 300, dim: int = 8, distinct: int | None = None, seed: int = 0):
    """n items with unique, unsorted, non-contiguous ids and random vectors (only
    ``distinct`` different ones when given: forces whole-code collisions)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(10 * n, generator=g)[:n] + 5
    base = torch.randn(distinct or n, dim, generator=g)
    vectors = base[torch.arange(n) % base.shape[0]]
    return ids, vectors


def prefixes(codes: torch.Tensor) -> list[set[tuple[int, ...]]]:
    """Brute force: the set of code prefixes of each length 0..L some item has."""
    return [{tuple(row[:length]) for row in codes.tolist()} for length in range(codes.shape[1] + 1)]


def test_item_code_item_round_trip_and_unknowns():
    ids, vecs = catalogue()
    sid = build_semantic_ids(ids, vecs, sizes=(8, 8))
    assert torch.equal(sid.item_ids, ids.sort().values)
    assert sid.num_levels == 3 and sid.codes.shape == (300, 3)
    codes = sid.codes_of(ids)
    assert (codes >= 0).all()
    assert torch.equal(sid.items_of(codes), ids)
    # leading dimensions are kept both ways
    assert torch.equal(sid.items_of(sid.codes_of(ids.view(3, 100))), ids.view(3, 100))
    unknown = torch.tensor([0, 10**9, -1, int(ids.max()) + 1])
    assert (sid.codes_of(unknown) == -1).all()
    # codes no item has: out of range on any level, negative, or an unused in-range code
    bad = codes[:4].clone()
    bad[0, 0] = 8
    bad[1, 1] = -1
    bad[2, 2] = sid.sizes[2]
    bad[3, 2] = sid.sizes[2] - 1
    if sid.items_of(bad[3:4]).item() != -1:  # that last code exists: take a full code nobody has
        used = {tuple(r) for r in sid.codes.tolist()}
        bad[3] = torch.tensor(next(c for c in ((a, b, z) for a in range(8) for b in range(8) for z in range(2))
                                   if c not in used))
    assert (sid.items_of(bad) == -1).all()


def test_every_item_one_code_every_code_one_item_under_collisions():
    ids, vecs = catalogue(n=200, distinct=5)  # 40 items per vector: they share all k-means codes
    sid = build_semantic_ids(ids, vecs, sizes=(4, 4))
    assert torch.unique(sid.codes, dim=0).shape[0] == 200
    assert sid.sizes[-1] == 40 and sid.stats()["max_collisions"] == 40 and sid.stats()["collision_rate"] == 1.0
    assert torch.equal(sid.items_of(sid.codes_of(ids)), ids)
    # the first levels are shared by exactly the items with the same vector
    groups = torch.unique(sid.codes[:, :2], dim=0, return_counts=True)[1]
    assert sorted(groups.tolist()) == [40] * 5
    # from_codes refuses what would break the contract
    with pytest.raises(SemanticIdError, match="shared by more than one item"):
        SemanticIds.from_codes(torch.tensor([1, 2, 3]), torch.tensor([[0, 1], [0, 1], [1, 0]]), (2, 2))
    with pytest.raises(SemanticIdError, match="item 2 appears more than once"):
        SemanticIds.from_codes(torch.tensor([1, 2, 2]), torch.tensor([[0, 1], [0, 0], [1, 0]]), (2, 2))
    with pytest.raises(SemanticIdError, match="outside"):
        SemanticIds.from_codes(torch.tensor([1, 2]), torch.tensor([[0, 1], [0, 2]]), (2, 2))


def test_fewer_items_than_codes():
    sid = build_semantic_ids(torch.tensor([9, 4, 7]), torch.randn(3, 4), sizes=(8, 8))
    assert (sid.codes[:, 0] < 3).all() and torch.unique(sid.codes, dim=0).shape[0] == 3
    assert torch.equal(sid.items_of(sid.codes), torch.tensor([4, 7, 9]))


def test_trie_admits_exactly_the_prefixes_items_have():
    ids, vecs = catalogue(n=400, distinct=150, seed=1)
    sid = build_semantic_ids(ids, vecs, sizes=(6, 5, 4))
    known = prefixes(sid.codes)
    for level in range(sid.num_levels):
        assert sid.children[level].shape == (len(known[level]), sid.sizes[level])
        for p in known[level]:
            node = sid.nodes_of(torch.tensor([p], dtype=torch.long).view(1, level))
            assert node.item() >= 0
            row = sid.step(node, level)[0]
            for c in range(sid.sizes[level]):
                child = p + (c,)
                assert (row[c].item() >= 0) == (child in known[level + 1]), (p, c)
                if row[c] >= 0:
                    assert sid.nodes_of(torch.tensor([child])).item() == row[c].item()
    assert sid.nodes_of(torch.tensor([[5, 4, 3]])).item() == -1 or (5, 4, 3) in known[3]
    assert sid.nodes_of(torch.zeros(2, 0, dtype=torch.long)).tolist() == [0, 0]
    with pytest.raises(IndexError):
        sid.step(torch.tensor([-1]), 0)  # a gather that never wraps a dead node to a live one


def test_random_beams_through_step_always_end_on_a_real_item():
    ids, vecs = catalogue(n=500, distinct=200, seed=2)
    sid = build_semantic_ids(ids, vecs, sizes=(8, 8))
    g = torch.Generator().manual_seed(0)
    k = 256
    node = torch.zeros(k, dtype=torch.long)
    walked = []
    for level in range(sid.num_levels):
        nxt = sid.step(node, level)
        # a random logit per code, masked as the beam search masks: only children with items
        logits = torch.rand(nxt.shape, generator=g).masked_fill(nxt < 0, -1.0)
        code = logits.argmax(1)
        walked.append(code)
        node = nxt[torch.arange(k), code]
        assert (node >= 0).all()
    items = sid.leaf_item[node]
    assert torch.isin(items, ids).all()
    assert torch.equal(sid.codes_of(items), torch.stack(walked, 1))


def test_rq_kmeans_is_deterministic_and_each_level_explains_residual():
    x = torch.randn(400, 8, generator=torch.Generator().manual_seed(3))
    codes = rq_kmeans(x, (16, 16, 16), iters=10, seed=7)
    assert torch.equal(codes, rq_kmeans(x, (16, 16, 16), iters=10, seed=7))
    assert not torch.equal(codes, rq_kmeans(x, (16, 16, 16), iters=10, seed=8))
    assert codes.shape == (400, 3) and codes.min() >= 0 and codes.max() < 16
    # each level's centroids are its clusters' means of what the levels before left
    r, norms = x.clone(), [x.square().sum().item()]
    for level in range(3):
        c = codes[:, level]
        means = torch.zeros(16, 8).index_add_(0, c, r) / torch.bincount(c, minlength=16).clamp_min(1)[:, None]
        r = r - means[c]
        norms.append(r.square().sum().item())
    assert all(b < 0.8 * a for a, b in zip(norms, norms[1:])), norms


def test_kmeans_with_fewer_distinct_points_than_centroids():
    x = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]).repeat(10, 1)
    codes, cent = kmeans(x, 8, iters=10)
    assert cent.shape[0] == 3 and torch.unique(codes).numel() == 3
    torch.testing.assert_close(cent[codes], x)


def test_balanced_levels_use_codes_evenly():
    x = torch.randn(103, 4, generator=torch.Generator().manual_seed(4))
    codes = rq_kmeans(x, (10, 10), iters=5, balanced=True)
    for level in range(2):
        assert sorted(torch.bincount(codes[:, level], minlength=10).tolist()) == [10] * 7 + [11] * 3


def test_stats_by_hand():
    sid = SemanticIds.from_codes(torch.tensor([1, 2, 3, 4]), torch.tensor([[0, 0], [0, 1], [1, 0], [2, 0]]), (4, 2))
    s = sid.stats()
    assert s["items"] == 4 and s["levels"] == 2 and s["sizes"] == [4, 2]
    assert s["collision_rate"] == 0.5 and s["max_collisions"] == 2
    assert s["used_per_level"] == [0.75, 1.0]
    assert s["perplexity_per_level"] == pytest.approx([2**1.5, 0.75**-0.75 * 0.25**-0.25])


def test_state_dict_save_load_round_trip(tmp_path):
    ids, vecs = catalogue(n=120, distinct=40)
    sid = build_semantic_ids(ids, vecs, sizes=(4, 4))
    again = SemanticIds.from_state_dict(sid.state_dict())
    assert set(sid.state_dict()) == {"item_ids", "codes", "sizes"}
    path = tmp_path / "sid.safetensors"
    sid.save(path)
    loaded = SemanticIds.load(path)
    for other in (again, loaded):
        assert other.sizes == sid.sizes
        for name in ("item_ids", "codes", "leaf_item"):
            assert torch.equal(getattr(other, name), getattr(sid, name)), name
        assert all(torch.equal(a, b) for a, b in zip(other.children, sid.children))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["stats"]) == sid.stats()
    with pytest.raises(SemanticIdError, match="lacks"):
        SemanticIds.from_state_dict({"codes": sid.codes, "sizes": torch.tensor(sid.sizes)})
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(SemanticIdError, match="genrec sid build"):
        SemanticIds.load(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(SemanticIdError, match="not a readable"):
        SemanticIds.load(tmp_path / "junk.safetensors")


def cli(capfd, *args):
    from genrec.cli import main

    capfd.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    out = capfd.readouterr()
    return code, out.out, out.err


def test_sid_build_help_and_user_errors(capfd, tmp_path):
    code, out, _ = cli(capfd, "sid", "build", "--help")
    assert code == 0 and all(w in out for w in ("--checkpoint", "--out", "--levels", "--iters", "--seed"))
    code, _, err = cli(capfd, "sid", "build", "--checkpoint", tmp_path / "nowhere")
    assert code == 2 and "neither a run directory" in err
    code, _, err = cli(capfd, "sid", "build", "--checkpoint", tmp_path, "--levels", "256,x")
    assert code != 0 and "--levels '256,x'" in err


def test_sid_build_on_a_tiny_trained_run(capfd, tiny_synth, tmp_path):
    from genrec.train.job import load_job
    from genrec.train.loop import checkpoint as ckpt
    from genrec.train.loop.launch import run_training
    from genrec.train.sid_build import load_item_vectors

    cfg = tmp_path / "tiny.toml"
    cfg.write_text('[[embedding.tables]]\nname = "item"\nfeatures = ["item"]\ndim = 16\n')
    run_dir, _ = run_training(load_job(cfg, tiny_job_overrides(tiny_synth, tmp_path) + ["--train.max_epochs=1"]))
    code, out, err = cli(capfd, "sid", "build", "--checkpoint", run_dir, "--levels", "8,8", "--iters", "5")
    assert code == 0, err
    path, meta = run_dir / "sid.safetensors", run_dir / "sid.json"
    sid = SemanticIds.load(path)
    ids, vecs = load_item_vectors(*ckpt.resolve_checkpoint(run_dir))
    assert torch.equal(sid.item_ids, ids) and torch.equal(sid.items_of(sid.codes_of(ids)), ids)
    # the file is what the library builds from the run's vectors
    assert torch.equal(sid.codes, build_semantic_ids(ids, vecs, (8, 8), iters=5).codes)
    manifest = json.loads(meta.read_text())
    assert manifest["stats"] == sid.stats() and manifest["build"]["levels"] == [8, 8]
    assert manifest["tensors"]["codes"]["shape"] == list(sid.codes.shape)
    s = sid.stats()
    assert f"{s['items']} items, sizes 8,8,{sid.sizes[-1]}, collision rate {s['collision_rate']:.2%}" in out
    # --out as a directory, and as a file with its own .json
    assert cli(capfd, "sid", "build", "--checkpoint", run_dir, "--levels", "4", "--out", tmp_path / "o")[0] == 0
    assert (tmp_path / "o" / "sid.safetensors").exists() and (tmp_path / "o" / "sid.json").exists()
    assert cli(capfd, "sid", "build", "--checkpoint", run_dir, "--levels", "4", "--out", tmp_path / "c.safetensors")[0] == 0
    assert SemanticIds.load(tmp_path / "c.safetensors").sizes[0] == 4 and (tmp_path / "c.json").exists()


def test_kmeans_above_the_sample_cap_fits_on_a_sample_and_assigns_every_point(monkeypatch):
    """At 10^7 items Lloyd's iterations run on k * sample_per_centroid points drawn at random
    and every point is assigned once: the contract stays (each point's code is its nearest
    centroid, the centroids its clusters' means, deterministic for a generator), and the
    iterations never see more than the sample."""
    import genrec.models.sid as sid_mod

    g = torch.Generator().manual_seed(5)
    centres = torch.randn(6, 8, generator=g) * 4
    x = centres[torch.randint(6, (3000,), generator=g)] + 0.1 * torch.randn(3000, 8, generator=g)
    seen_rows: list[int] = []
    pp = sid_mod._kmeans_pp
    monkeypatch.setattr(sid_mod, "_kmeans_pp", lambda x, *a: seen_rows.append(x.shape[0]) or pp(x, *a))
    codes, cent = kmeans(x, 6, iters=10, gen=torch.Generator().manual_seed(1), sample_per_centroid=20)
    assert seen_rows == [120]  # the seeding and the iterations ran on the sample only
    again, _ = kmeans(x, 6, iters=10, gen=torch.Generator().manual_seed(1), sample_per_centroid=20)
    assert torch.equal(codes, again)
    d = (x.square().sum(1, keepdim=True) - 2 * x @ cent.T + cent.square().sum(1))
    assert torch.equal(codes, d.argmin(1))  # nearest centroid, every point
    counts = torch.bincount(codes, minlength=6)
    means = torch.zeros_like(cent).index_add_(0, codes, x) / counts.clamp_min(1)[:, None]
    torch.testing.assert_close(cent[counts > 0], means[counts > 0])
    # the well-separated clusters are found from 120 of the 3000 points
    assert torch.unique(torch.stack([codes, torch.cdist(x, centres).argmin(1)], 1), dim=0).shape[0] == 6
    seen_rows.clear()
    kmeans(x, 6, iters=10, sample_per_centroid=0)
    assert seen_rows == [3000]  # 0: no sample


def test_unique_rows_equals_torch_unique_over_rows():
    from genrec.models.sid import unique_rows

    codes = torch.randint(5, (500, 3), generator=torch.Generator().manual_seed(2))
    _, inv, counts = torch.unique(codes, dim=0, return_inverse=True, return_counts=True)
    got_inv, got_counts = unique_rows(codes)
    assert torch.equal(got_inv, inv) and torch.equal(got_counts, counts)
    wide = torch.tensor([[2**40, 1], [2**40, 0], [0, 2**40]])  # beyond 63 bits of mixed radix: the row sort
    _, inv, counts = torch.unique(wide, dim=0, return_inverse=True, return_counts=True)
    assert all(torch.equal(a, b) for a, b in zip(unique_rows(wide), (inv, counts)))


def test_a_sparse_trie_level_answers_as_the_dense_one(monkeypatch):
    """Above DENSE_TRIE_ENTRIES a level is kept as sorted child keys (at 10^7 items the dense
    last level asked for 32.8 GB): step, nodes_of and items_of answer exactly as dense, and
    the decoder's loss and beam search are unchanged."""
    import genrec.models.sid as sid_mod
    from genrec.models.sid_decoder import SIDConfig, SIDDecoder

    ids, vecs = catalogue(n=300, distinct=120)
    dense = build_semantic_ids(ids, vecs, sizes=(4, 3, 5))
    monkeypatch.setattr(sid_mod, "DENSE_TRIE_ENTRIES", 0)
    sparse = SemanticIds.from_codes(dense.item_ids, dense.codes, dense.sizes)
    assert all(k is not None and c.numel() == 0 for k, c in zip(sparse.level_keys, sparse.children))
    g = torch.Generator().manual_seed(0)
    for level in range(dense.num_levels):
        nodes = torch.arange(dense.children[level].shape[0])
        assert torch.equal(sparse.step(nodes, level), dense.step(nodes, level))
        assert torch.equal(sparse.step(nodes.flip(0)[:, None].repeat(1, 2), level),
                           dense.step(nodes.flip(0)[:, None].repeat(1, 2), level))
        prefixes = torch.randint(-1, 7, (200, level + 1), generator=g)
        assert torch.equal(sparse.nodes_of(prefixes), dense.nodes_of(prefixes))
    codes = torch.cat([dense.codes[:50], torch.randint(0, 5, (50, 4), generator=g)])
    assert torch.equal(sparse.items_of(codes), dense.items_of(codes))
    with pytest.raises(IndexError):
        sparse.step(torch.tensor([0, -1]), 1)
    torch.manual_seed(0)
    dec = SIDDecoder(SIDConfig(enabled=True, codebook="unused", num_layers=1, dropout=0.0), 8, dense).eval()
    h, targets = torch.randn(6, 8, generator=g), ids[:6]
    want_loss, want_beam = dec.loss(h, targets), dec.beam_search(h, 10)
    dec.sid = sparse
    torch.testing.assert_close(dec.loss(h, targets), want_loss)
    assert all(torch.equal(a, b) for a, b in zip(dec.beam_search(h, 10), want_beam))
