"""Bounded attention over long histories (``kernels.hstu_bounded``): the padded pass against the
formula written per query, the full attention where the window holds everything, and the tower's
serving path (encode a history, score candidates against its cache) against the training pass
with the candidates as targets."""

import pytest
import torch
import torch.nn.functional as F

from genrec.kernels.hstu_attention import hstu_attention_reference, time_bucket
from genrec.kernels.hstu_bounded import hstu_bounded_attention
from genrec.kernels.jagged import lengths_to_offsets
from genrec.models.hstu import HSTUConfig, HSTUTower, JaggedMeta, PagedMeta

N = 64  # max_seq_len
ITEMS = 500  # the bounded artifact's catalogue


def loop_bounded(q, k, v, lengths, nt, window, block, pos_w, time_w, ts, qt):
    """Per sequence and query: its window keys and the summaries of the whole blocks before."""
    out, start = [], 0
    alpha = q.shape[-1] ** -0.5
    for b, n in enumerate(lengths.tolist()):
        hist = n - int(nt[b])
        for i in range(n):
            p = min(i, hist)
            ns = max(0, (p - window + 1) // block)
            terms = [(k[start + j], v[start + j], j, ts[start + j]) for j in range(ns * block, n)
                     if (j <= i if i < hist else (j < hist or j == i))]
            for s in range(ns):
                rows = slice(start + s * block, start + (s + 1) * block)
                last = start + (s + 1) * block - 1
                terms.append((k[rows].mean(0), v[rows].sum(0), (s + 1) * block - 1, ts[last]))
            acc = torch.zeros_like(v[0])
            for kk, vv, pj, tj in terms:
                sc = (q[start + i] * kk).sum(-1) * alpha + pos_w[min(max(p - min(pj, hist), 0), N - 1)]
                sc = sc + time_w[time_bucket(qt[start + i] - tj, time_w.numel())]
                acc = acc + (F.silu(sc) / N)[:, None] * vv
            out.append(acc)
        start += n
    return torch.stack(out)


def case(lengths, targets, seed=0, heads=2, d=8):
    g = torch.Generator().manual_seed(seed)
    t = int(sum(lengths))
    q, k, v = (torch.randn(t, heads, d, generator=g, dtype=torch.float64) for _ in range(3))
    ts = torch.cumsum(torch.randint(0, 5000, (t,), generator=g), 0)
    qt = ts + torch.randint(0, 100, (t,), generator=g)
    kw = dict(max_seq_len=N, alpha=d**-0.5, pos_weights=torch.randn(N, generator=g, dtype=torch.float64),
              time_weights=torch.randn(16, generator=g, dtype=torch.float64), timestamps=ts, query_times=qt,
              num_targets=torch.tensor(targets))
    return q, k, v, torch.tensor(lengths), kw


@pytest.mark.parametrize("window,block", [(5, 3), (1, 4), (9, 2), (4, 16)])
def test_bounded_matches_the_per_query_formula(window, block):
    lengths, targets = [23, 0, 11, 30, 2], [3, 0, 0, 5, 1]
    q, k, v, lens, kw = case(lengths, targets)
    out = hstu_bounded_attention(q, k, v, lengths_to_offsets(lens), window=window, block=block, **kw)
    want = loop_bounded(q, k, v, lens, kw["num_targets"], window, block, kw["pos_weights"], kw["time_weights"],
                        kw["timestamps"], kw["query_times"])
    torch.testing.assert_close(out, want)


def test_a_window_over_everything_is_the_full_attention_and_trains_alike():
    q, k, v, lens, kw = case([17, 0, 40, 6], [2, 0, 4, 0], seed=1)
    for t in (q, k, v, kw["pos_weights"], kw["time_weights"]):
        t.requires_grad_()
    offsets = lengths_to_offsets(lens)
    out = hstu_bounded_attention(q, k, v, offsets, window=40, block=8, **kw)
    ref = hstu_attention_reference(q, k, v, offsets, **kw)
    torch.testing.assert_close(out, ref)
    leaves = [q, k, v, kw["pos_weights"], kw["time_weights"]]
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(a, b)


def tower(window: int, seed: int = 0) -> HSTUTower:
    torch.manual_seed(seed)
    cfg = HSTUConfig(num_layers=2, num_heads=2, qk_dim=8, v_dim=8, dropout=0.0, num_time_buckets=32, window=window,
                     summary_block=4)
    t = HSTUTower(cfg, 16, N).eval()
    with torch.no_grad():
        for layer in t.layers:
            layer.pos_weights.normal_(0, 1.0)
            layer.time_weights.normal_(0, 1.0)
    return t


@pytest.mark.parametrize("window", [0, 6, 13])
@pytest.mark.parametrize("backend", ["torch", "torch-bf16"])
def test_serving_scores_candidates_as_training_sees_targets(window, backend):
    """encode_history + extend (cached keys, blocked candidates) == forward with the candidates
    appended as targets, seen at the request time (window 0: full attention)."""
    m = tower(window)
    g = torch.Generator().manual_seed(3)
    lens, ncand = torch.tensor([30, 1, 17, 45]), torch.tensor([3, 2, 0, 4])
    t = int(lens.sum())
    x = torch.randn(t, 16, generator=g)
    ts = torch.cumsum(torch.randint(0, 3000, (t,), generator=g), 0)
    qt = ts + 7
    meta = JaggedMeta(lengths_to_offsets(lens), int(lens.max()), ts, qt, None)
    owner = torch.repeat_interleave(torch.arange(4), ncand)
    cands = torch.randn(owner.numel(), 16, generator=g)
    xs, tss, qts, rows, row, c0 = [], [], [], [], 0, 0
    for u in range(4):
        s, e, c = int(meta.offsets[u]), int(meta.offsets[u + 1]), int(ncand[u])
        req = qt[e - 1]
        xs += [x[s:e], cands[c0 : c0 + c]]
        tss += [ts[s:e], req.expand(c)]
        qts += [qt[s:e], req.expand(c)]
        rows += list(range(row + e - s, row + e - s + c))
        row, c0 = row + e - s + c, c0 + c
    full_meta = JaggedMeta(lengths_to_offsets(lens + ncand), int((lens + ncand).max()), torch.cat(tss), torch.cat(qts),
                           ncand)
    with torch.inference_mode():
        want = m(torch.cat(xs), full_meta)[torch.tensor(rows)]
        _, hist = m.encode_history(x, meta)
        got = m.extend(cands, hist, owner, backend=backend)
    tol = dict(atol=5e-2, rtol=5e-2) if backend.endswith("bf16") else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)


def test_bounded_config_is_checked_and_refuses_incremental_extend():
    with pytest.raises(ValueError, match="window"):
        HSTUConfig(window=-1)
    m = tower(6)
    assert not m.native_supported()
    with pytest.raises(ValueError, match="bounded tower"):  # a pool, or candidates in the pass: not supported
        m.extend_paged(torch.zeros(1, 16), PagedMeta(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                                    torch.ones(1, dtype=torch.int64), None, None,
                                                    hist_lengths=torch.ones(1, dtype=torch.int64)), None)


@pytest.mark.parametrize("window,block,lengths,new", [
    (5, 3, [23, 11, 30, 2], [3, 1, 12, 2]), (9, 2, [23, 11, 30, 2], [3, 1, 12, 2]),
    (4, 16, [23, 11, 30, 2], [3, 1, 12, 2]),
    (40, 8, [600, 11], [530, 1]),  # new rows over several row blocks (a chunk of a cold prefill)
])
def test_a_grown_history_extends_its_cached_keys_as_the_whole_pass_encodes_it(window, block, lengths, new):
    """The new events of grown histories against their cached keys / values
    (``hstu_bounded_paged_attention``) == the whole sequences' bounded pass at those rows."""
    from genrec.kernels.hstu_bounded import hstu_bounded_paged_attention

    q, k, v, lens, kw = case(lengths, [0] * len(lengths), seed=2)
    kw.pop("num_targets")
    offsets = lengths_to_offsets(lens)
    want = hstu_bounded_attention(q, k, v, offsets, window=window, block=block, **kw)
    b, L = len(lengths), max(lengths)
    kp, vp = (torch.zeros(b, L, *t.shape[1:], dtype=t.dtype) for t in (k, v))
    times = torch.zeros(b, L, dtype=torch.int64)
    seq, index, rows = [], [], []
    for i, (n, m) in enumerate(zip(lengths, new)):
        s = int(offsets[i])
        kp[i, :n], vp[i, :n], times[i, :n] = k[s : s + n], v[s : s + n], kw["timestamps"][s : s + n]
        seq += [i] * m
        index += list(range(n - m, n))
        rows += list(range(s + n - m, s + n))
    rows_t = torch.tensor(rows)
    got = hstu_bounded_paged_attention(
        q[rows_t], kp, vp, torch.tensor(seq), torch.tensor(index), lens, window=window, block=block,
        max_seq_len=N, alpha=kw["alpha"], pos_weights=kw["pos_weights"], time_weights=kw["time_weights"],
        key_times=times, query_times=kw["query_times"][rows_t])
    torch.testing.assert_close(got, want[rows_t])


def bounded_artifact(tmp_path):  # noqa: ANN001, ANN201
    """A bounded ranking model (window 64, summaries of 16) and its fp32 artifact."""
    from genrec.config import to_dict
    from genrec.embedding.spec import EmbeddingConfig, TableConfig
    from genrec.models.ranking import RankingConfig, TaskConfig
    from genrec.models.recommender import GenerativeRecommender, ModelConfig
    from genrec.quant.artifact import Manifest, save_artifact
    from genrec.quant.dense import dense_tensors
    from genrec.quant.embeddings import table_tensors

    torch.manual_seed(0)
    tables = (TableConfig("item", ("item",), dim=16, num_embeddings=ITEMS + 1),
              TableConfig("action", ("action",), dim=16, num_embeddings=4))
    cfg = ModelConfig(max_seq_len=1024, input_dropout=0.0, ranking=RankingConfig(
        tasks=(TaskConfig("click", ("click",)),), hidden=(8,), dropout=0.0),
        hstu=HSTUConfig(num_layers=2, num_heads=2, qk_dim=8, v_dim=8, dropout=0.0, window=64, summary_block=16))
    model = GenerativeRecommender(cfg, EmbeddingConfig(tables=tables), torch.arange(1, ITEMS + 1)).eval()
    art = save_artifact(tmp_path / "art", Manifest(to_dict(model.cfg), to_dict(model.embedding_cfg),
                                                   {"embeddings": "fp32", "dense": "fp32", "row_alignment": 16}),
                        {"embeddings.safetensors": table_tensors(model.sparse, "fp32"),
                         "dense.safetensors": dense_tensors(model, "fp32")})
    return model, art


def test_the_sglang_engine_serves_a_bounded_model_as_the_torch_engine(tmp_path):
    """A bounded model behind the SGLang engine (its keys / values in SGLang's pool, a grown
    history prefilled over its cached prefix) answers as the torch engine without a cache."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:  # (not imported here: the engine installs its shims first)
        pytest.skip("SGLang is not installed (bash .ci/setup-sglang)")
    import numpy as np

    from genrec.proto.v1 import recommender_pb2 as pb
    from genrec.serve.engine import TorchEngine
    from genrec.serve.requests import Limits, decode
    from genrec.serve.sglang_engine import SGLangEngine

    _, art = bounded_artifact(tmp_path)
    rng = np.random.default_rng(2)
    items = rng.integers(1, ITEMS + 1, 300)
    times = 1_700_000_000 + np.cumsum(rng.integers(0, 900, 300))
    cands = rng.integers(1, ITEMS + 1, 30)

    def rank(schema, n: int):  # noqa: ANN001, ANN202
        req = pb.RankRequest()
        req.user.user_id = "long"
        for i, t in zip(items[:n], times[:n]):
            req.user.history.add(item_id=int(i), timestamp=int(t), actions=1)
        for c in cands:
            req.candidates.add(item_id=int(c), bid=1.0)
        return decode("rank", req.SerializeToString(), schema, Limits())

    te, se = TorchEngine(art), SGLangEngine(art, pool_tokens=4096, threads=1)
    try:
        for n in (200, 203, 260):  # cold, then grown by a few events and past a block
            (want,), (got,) = te.run([rank(te.schema, n)]), se.run([rank(se.schema, n)])
            np.testing.assert_array_equal(got.item_ids, want.item_ids)
            np.testing.assert_allclose(got.tasks["click"], want.tasks["click"], atol=1e-5)
        assert got.cached_tokens > 200  # (the grown history read its prefix from the pool)
    finally:
        se.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_engine_serves_a_bounded_model_as_training_ranks(tmp_path, precision):
    """A bounded model's artifact behind TorchEngine (K/V cache on, called twice: the second
    call finds the first 595 of its 600 events cached and reuses 594 of them) ranks a
    600-event user's candidates as the model's training pass ranks them as targets."""
    import numpy as np

    from genrec.proto.v1 import recommender_pb2 as pb
    from genrec.serve.engine import TorchEngine, collate_users
    from genrec.serve.requests import Limits, decode

    model, art = bounded_artifact(tmp_path)
    items = ITEMS
    rng = np.random.default_rng(0)
    req = pb.RankRequest()
    req.user.user_id = "long"
    for i, t in zip(rng.integers(1, items + 1, 600), 1_700_000_000 + np.cumsum(rng.integers(0, 900, 600))):
        req.user.history.add(item_id=int(i), timestamp=int(t), actions=1)
    cands = rng.integers(1, items + 1, 50)
    for c in cands:
        req.candidates.add(item_id=int(c), bid=1.0)
    engine = TorchEngine(art, kv_cache_mb=8, candidate_precision=precision)
    work = decode("rank", req.SerializeToString(), engine.schema, Limits())
    earlier = pb.RankRequest()
    earlier.CopyFrom(req)
    del earlier.user.history[595:]
    engine.run([decode("rank", earlier.SerializeToString(), engine.schema, Limits())])
    (res,) = engine.run([work])
    assert res.cached_tokens == 594  # (the last cached event is encoded again: its query time moved)
    with torch.inference_mode():
        want = model.rank(collate_users([work.user], model, torch.device("cpu"), [work.candidates]))[:, 0].numpy()
    got = dict(zip(res.item_ids.tolist(), res.tasks["click"].tolist()))
    np.testing.assert_allclose([got[int(c)] for c in cands], want, atol=2e-3 if precision == "fp32" else 1e-2)


def test_block_summaries_kept_between_calls_answer_as_a_fresh_engine(tmp_path):
    """A bounded tower's block summaries live with the cached history (``Entry.sums``): each call
    recomputes only the blocks its new tokens touch. Grown by a few events, by enough to close
    blocks, and with an event changed mid-history (the prefix ends inside a block: that block
    and every later one are recomputed), the answers equal an engine without a cache."""
    import numpy as np

    from genrec.proto.v1 import recommender_pb2 as pb
    from genrec.serve.engine import TorchEngine
    from genrec.serve.requests import Limits, decode

    _, art = bounded_artifact(tmp_path)
    cached, fresh = TorchEngine(art, kv_cache_mb=8), TorchEngine(art)
    rng = np.random.default_rng(1)
    items = rng.integers(1, ITEMS + 1, 400)
    times = 1_700_000_000 + np.cumsum(rng.integers(0, 900, 400))
    cands = rng.integers(1, ITEMS + 1, 40)

    def call(engine: TorchEngine, n: int, changed: int | None = None) -> np.ndarray:
        req = pb.RankRequest()
        req.user.user_id = "long"
        for j, (i, t) in enumerate(zip(items[:n], times[:n])):
            req.user.history.add(item_id=int(i), timestamp=int(t), actions=2 if j == changed else 1)
        for c in cands:
            req.candidates.add(item_id=int(c), bid=1.0)
        (res,) = engine.run([decode("rank", req.SerializeToString(), engine.schema, Limits())])
        return res.tasks["click"][np.argsort(res.item_ids)]

    call(cached, 200)
    for n, changed in ((203, None), (240, None), (241, None), (241, 150), (300, 150)):
        np.testing.assert_allclose(call(cached, n, changed), call(fresh, n, changed), atol=1e-5)
        entry = cached.cache.entries["long"]
        assert entry.sums is not None and entry.sums[0].blocks == n // 16
