"""The native serving path (the tower's native backend, kernels/cpu/hstu_serve.cpp, and serve.native's
lookups and heads) computes what the model's batch path computes."""

import numpy as np
import pytest
import torch

from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.kernels.hstu_attention import time_bucket
from genrec.kernels.hstu_native import library, time_thresholds
from genrec.models.hstu import HSTUConfig
from genrec.models.ranking import RankingConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.serve.engine import native_ok as supports
from genrec.serve.packed import PackedPath, context_kjt
from genrec.serve.requests import UserInput
from tests.test_padded_serving import T0, TASKS, model, padded_scores, reference

pytestmark = pytest.mark.skipif(library() is None, reason="no C++ compiler: the native kernels did not build")


def test_long_histories_odd_widths_and_several_query_blocks():
    """Histories past one block of 64 query rows (up to 149 events), a model width of 24 and
    a G of 40 (a 16-wide and an 8-wide column tile), a qk width of 12: same numbers."""
    torch.manual_seed(1)
    tables = (TableConfig("item", ("item",), dim=24, num_embeddings=300),
              TableConfig("action", ("action",), dim=24, num_embeddings=4))
    hstu = HSTUConfig(num_layers=2, num_heads=1, qk_dim=12, v_dim=8, dropout=0.0, num_time_buckets=64)
    cfg = ModelConfig(tower="hstu", max_seq_len=150, input_dropout=0.0, hstu=hstu,
                      ranking=RankingConfig(tasks=TASKS, dropout=0.0, use_context=False))
    m = GenerativeRecommender(cfg, EmbeddingConfig(tables=tables), torch.arange(1, 300)).eval()
    rng = np.random.default_rng(3)
    us = []
    for n in (70, 1, 149, 200, 64, 65, 90):
        times = T0 + np.cumsum(rng.choice([0, 5, 3_600, 10**6], n))
        if n == 90:  # events out of time order: the bias codes' per-pair search, not the per-row walk
            times = rng.permutation(times)
        us.append(UserInput(items=rng.integers(1, 300, n), times=times, actions=rng.integers(0, 4, n),
                            has_time=True, request_time=int(times.max()) + 7))
    cands = [(i, rng.integers(1, 300, k)) for i, k in ((2, 9), (0, 1), (3, 20), (5, 3), (4, 0), (1, 2), (6, 5))]
    vec, probs = reference(m, us, cands)
    assert supports(m)
    path = PackedPath(m, "native")
    nvec, hist = path.encode(us)
    torch.testing.assert_close(nvec, vec, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(padded_scores(path, hist, cands), probs, atol=2e-5, rtol=2e-5)


def test_native_retrieval_is_the_mm_and_topk_of_pytorch_with_history_excluded_and_ties_in_order():
    """Catalogue of 203 items (columns padded to 208), a width of 24: the top k equal torch's
    mm / temperature + topk with each user's history at -inf; equal scores (duplicated item
    vectors) come lowest position first; k = N returns the excluded items last, at -inf."""
    torch.manual_seed(2)
    path = PackedPath(model(), "native").kernels  # (retrieval reads only the vectors it is given)
    d, n = 24, 203
    items = torch.randn(n, d)
    items[50] = items[10]  # a tie in every user's scores
    users = torch.randn(5, d)
    items_t = torch.nn.functional.pad(items.t().contiguous(), (0, -n % 8)).contiguous()
    corpus = np.arange(1000, 1000 + 3 * n, 3)  # sorted catalogue ids
    rng = np.random.default_rng(0)
    exclude = [rng.choice(corpus, 12), np.zeros(0, np.int64), np.array([5, corpus[7], 10**9]), corpus[:n - 4],
               rng.choice(corpus, 3)]
    ref = (users @ items.t()) / 0.07
    for b, ex in enumerate(exclude):
        ref[b, torch.from_numpy(np.searchsorted(corpus, ex[np.isin(ex, corpus)]))] = -torch.inf
    for k in (1, 10, n):
        pos, val = path.retrieve(users, items_t, corpus, 0.07, exclude, k)
        top = torch.topk(ref, k, dim=1)
        np.testing.assert_allclose(val, top.values.numpy(), rtol=1e-5, atol=1e-5)
        for b in range(5):
            finite = np.isfinite(val[b])
            # same set of items where scores are finite; the order of equal scores: lower position first
            assert set(pos[b][finite]) == set(top.indices[b].numpy()[np.isfinite(top.values[b].numpy())])
            keys = list(zip(-val[b], pos[b]))
            assert keys == sorted(keys)
        if k == n:  # user 3 excluded all but 4 items
            assert np.all(np.isfinite(val[3, :4])) and np.all(val[3, 4:] == -np.inf)
    pos, _ = path.retrieve(users, items_t, corpus, 0.07, None, n)
    assert all(sorted(p) == list(range(n)) for p in pos)
    with pytest.raises(ValueError):
        path.retrieve(users, items_t, corpus, 0.07, None, n + 1)


def test_time_buckets_from_the_thresholds_are_time_bucket_exactly():
    thr = time_thresholds(64)
    assert thr[0] == 0 and np.all(np.diff(thr) >= 0)
    rng = np.random.default_rng(0)
    gaps = np.concatenate([rng.integers(-5, 2**31 - 1, 20_000), rng.integers(0, 1000, 2_000),
                           thr[thr < 2**31 - 1], thr[thr < 2**31 - 1] - 1, [0, 1, 2, 3, 2**31 - 1]])
    # what the native code does: the largest b with thr[b] <= gap, 0 for gaps <= 0
    native = np.where(gaps <= 0, 0, np.searchsorted(thr, gaps, side="right") - 1)
    assert np.array_equal(native, time_bucket(torch.from_numpy(gaps), 64).numpy())


def test_only_models_it_computes_take_the_native_path():
    m = model()
    assert supports(m)
    assert not supports(model(tower="transformer"))
    assert not supports(model(encoding="interleaved"))
    m.tower.to(torch.bfloat16)
    m.pos_emb.to(torch.bfloat16)
    assert not supports(m)
    with pytest.raises(ValueError, match="fp32 dense"):
        PackedPath(m, "native")


def test_the_library_builds_into_an_empty_cache_and_a_missing_compiler_falls_back(tmp_path, monkeypatch):
    from genrec.kernels import native

    monkeypatch.setenv("GENREC_NATIVE_CACHE", str(tmp_path))
    native._build.cache_clear()
    try:
        lib = native.library("hstu_serve")
        built = list(tmp_path.glob("hstu_serve-*.so"))
        assert lib is not None and len(built) == 1 and hasattr(lib, "genrec_hstu_encode")
        native._build.cache_clear()
        assert native.library("hstu_serve") is not None and list(tmp_path.glob("*.so")) == built  # reused
        monkeypatch.setattr(native, "_compiler", lambda: None)
        native._build.cache_clear()
        assert native.library("hstu_serve") is None
        monkeypatch.setenv("GENREC_NATIVE", "0")
        assert native.library("hstu_serve") is None
    finally:
        native._build.cache_clear()


@pytest.mark.parametrize("scheme", ["fp32", "fp16", "int8", "int4"])
def test_served_tables_gathered_natively_equal_the_pytorch_lookups(scheme):
    """A served artifact's tables (ServedRows: quantized rows): the native path gathers the
    token inputs and pools the context itself; user vectors, probabilities and the context
    equal the padded path's (fbgemm's dequantize, TorchRec's quantized EmbeddingBagCollection),
    for sum and mean pooling, several ids, a feature a user lacks, and candidates."""
    from dataclasses import replace

    from genrec.quant.embeddings import install, quantized_modules, served_rows, table_tensors
    from tests.test_padded_serving import CANDS, users

    m = model()
    cfg = replace(m.embedding_cfg, tables=(*m.embedding_cfg.tables,
                                           TableConfig("topic", ("topic",), dim=8, num_embeddings=9, pooling="mean")))
    m = GenerativeRecommender(replace(m.cfg), cfg, torch.arange(1, 60)).eval()
    tensors = table_tensors(m.sparse, scheme)
    ec, ebc = quantized_modules(cfg, tensors, scheme)
    install(m.sparse, ec, ebc, served_rows(cfg, tensors, scheme), served_rows(cfg, tensors, scheme, pooled=True))
    us = users()
    for i, u in enumerate(us):  # several ids, one, none
        u.context["topic"] = np.array([i % 9, (3 * i) % 9, 8])[: 3 - i % 3]
    del us[2].context["region"]
    us[5].context["topic"] = np.zeros(0, np.int64)
    path, padded = PackedPath(m, "native"), PackedPath(m, "torch")
    native = path.kernels
    assert native.rows is not None and native.pooled is not None
    torch.testing.assert_close(native.context(us), m.sparse.pooled(context_kjt(us, list(cfg.pooled_features))).values(),
                               rtol=1e-6, atol=1e-6)
    # one native call per batch (genrec_tokens, genrec_pooled) = a gather call per table, to the bit
    assert native.fused_tokens and native._pooled_args is not None
    ids, acts, pos = np.array([5, 1, 59, 7]), np.array([0, 3, 1, 2]), np.array([0, 1, 2, 9])
    rows = torch.empty(4, 16)
    fused, ctx = native.tokens(ids, acts, pos, rows), native.context(us)
    native.fused_tokens, plan, native._pooled_args = False, native._pooled_args, None
    rows_each = torch.empty(4, 16)
    assert torch.equal(native.tokens(ids, acts, pos, rows_each), fused) and torch.equal(rows_each, rows)
    assert torch.equal(native.context(us), ctx)
    native.fused_tokens, native._pooled_args = True, plan
    with pytest.raises(ValueError, match="outside its table"):
        native.tokens(np.array([3, 60]), np.array([0, 0]), np.array([0, 1]))
    us[0].context["topic"] = np.array([9])
    with pytest.raises(ValueError, match="topic: an id outside"):
        native.context(us)
    us[0].context["topic"] = np.array([1])
    nvec, nhist = path.encode(us)
    pvec, phist = padded.encode(us)
    torch.testing.assert_close(nvec, pvec, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(padded_scores(path, nhist, CANDS), padded_scores(padded, phist, CANDS),
                               atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="outside the table"):
        native.rows["item"].gather(np.array([3, 60]), torch.empty(2, 16))
    with pytest.raises(ValueError, match="holds every row"):  # one output row short
        native.rows["item"].gather(np.array([3, 4, 5]), torch.empty(2, 16))
    with pytest.raises(ValueError, match="holds every row"):
        native.pooled["region"].gather(np.array([1, 2]), torch.empty(2, 8), dst=np.array([0, 2]))


def test_a_history_in_storage_with_room_or_scattered_over_a_pool_is_scored_where_it_lies():
    """An entry grown in place lies in storage with room after each layer's rows; an SGLang
    pool scatters a history's rows over its slots: the native history keeps views of them
    (no copy, for the kernel or a PyTorch scorer) and the native scorer reads them where they
    lie, with the same scores as a packed history."""
    import dataclasses

    from genrec.kernels import hstu_native

    m = model()
    rng = np.random.default_rng(0)
    us = [UserInput(items=rng.integers(1, 60, n), times=T0 + np.arange(n) * 60, actions=rng.integers(0, 8, n),
                    has_time=True, request_time=T0 + n * 60) for n in (9, 14)]
    _, state = PackedPath(m, "native").encode(us)
    dense = state.history.native
    layers, t, w = dense.k.shape
    room_k, room_v = torch.zeros(layers, t + 5, w), torch.zeros(layers, t + 5, w)
    room_k[:, :t], room_v[:, :t] = dense.k, dense.v
    kept = hstu_native.history(room_k[:, :t], room_v[:, :t], torch.from_numpy(dense.offsets), None, None)
    assert kept.k.data_ptr() == room_k.data_ptr() and not kept.k.is_contiguous()  # views, no copy
    strided = dataclasses.replace(dense, k=room_k[:, :t], v=room_v[:, :t])
    slots = rng.permutation(3 * t)[:t]
    pool_k, pool_v = torch.zeros(layers, 3 * t, w), torch.zeros(layers, 3 * t, w)
    pool_k[:, torch.from_numpy(slots)], pool_v[:, torch.from_numpy(slots)] = dense.k, dense.v
    pooled = dataclasses.replace(dense, k=list(pool_k), v=list(pool_v), rows=slots.astype(np.int64))
    x, owner = torch.randn(7, 16), torch.tensor([0, 0, 0, 1, 1, 1, 1])
    tower = m.tower.native_weights()
    want = hstu_native.score(tower, x, dense, owner)
    assert torch.equal(hstu_native.score(tower, x, strided, owner), want)
    assert torch.equal(hstu_native.score(tower, x, pooled, owner), want)
    assert strided.k.data_ptr() == room_k.data_ptr()  # still the storage itself: nothing was copied
    for i in range(layers):  # the PyTorch scorer's view of the pooled history: the packed rows
        assert torch.equal(pooled.layer(i)[0], dense.k[i]) and torch.equal(pooled.layer(i)[1], dense.v[i])


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("time_bias", [True, False])
@pytest.mark.parametrize("paged", [False, True])
def test_native_extend_equals_encoding_the_whole_histories(ordered, time_bias, paged):
    """``tower.extend_native``: cached rows' keys / values in storage with room (an engine
    cache's) or scattered over a pool's rows through a slot map (SGLang's), new rows (one, a
    few, more than a query block of 64, a whole history) through the C++ kernel -> each
    history's last row and the new rows' keys / values as the PyTorch encode of every whole
    history gives them; event times in order (the walk over the thresholds) and not."""
    from genrec.models.hstu import HSTUTower, JaggedMeta

    torch.manual_seed(2)
    cfg = HSTUConfig(num_layers=2, num_heads=2, qk_dim=12, v_dim=8, dropout=0.0, num_time_buckets=64,
                     time_bias=time_bias)
    tower = HSTUTower(cfg, 24, 300).eval()
    with torch.no_grad():
        for layer in tower.layers:
            for p in (layer.pos_weights, layer.time_weights):
                if p is not None:
                    p.normal_(0, 0.5)
    rng = np.random.default_rng(4)
    lens, prefix = np.array([70, 200, 9, 140]), np.array([69, 120, 0, 5])
    offsets = np.concatenate([[0], np.cumsum(lens)])
    t = int(lens.sum())
    x = torch.randn(t, 24)
    times = np.concatenate([T0 + np.cumsum(rng.choice([0, 5, 3_600, 10**6], n)) for n in lens])
    if not ordered:
        times[offsets[1] : offsets[2]] = rng.permutation(times[offsets[1] : offsets[2]])
    qtimes = times + 60
    meta = JaggedMeta(torch.from_numpy(offsets), int(lens.max()), torch.from_numpy(times), torch.from_numpy(qtimes),
                      None)
    with torch.inference_mode():
        want, hist = tower.encode_history(x, meta)
        c, cap, w = tower.kv_dims(), 256, lens.size
        kp, vp = torch.zeros(c.layers, w, cap, c.key_width), torch.zeros(c.layers, w, cap, c.value_width)
        for i, (s, p) in enumerate(zip(offsets[:-1], prefix)):
            for layer, (k, v) in enumerate(hist.layers):
                kp[layer, i, :p], vp[layer, i, :p] = k[s : s + p].flatten(1), v[s : s + p].flatten(1)
        new = np.concatenate([np.arange(s + p, s + n) for s, p, n in zip(offsets[:-1], prefix, lens)])
        key_times = np.zeros((w, cap), np.int64)
        for i, (s, n) in enumerate(zip(offsets[:-1], lens)):
            key_times[i, :n] = times[s : s + n]
        if paged:  # the same rows at shuffled slots of a pool of per-layer buffers
            slots = rng.permutation(w * cap).reshape(w, cap).astype(np.int64)
            pk, pv = torch.zeros(c.layers, w * cap, c.key_width), torch.zeros(c.layers, w * cap, c.value_width)
            pk[:, torch.from_numpy(slots.ravel())] = kp.flatten(1, 2)
            pv[:, torch.from_numpy(slots.ravel())] = vp.flatten(1, 2)
            got = tower.extend_native(x[torch.from_numpy(new)], list(pk), list(pv), prefix, lens, key_times,
                                      qtimes[new], slots)
            kp[:], vp[:] = pk[:, torch.from_numpy(slots.ravel())].view_as(kp), pv[:, torch.from_numpy(slots.ravel())].view_as(vp)
        else:
            got = tower.extend_native(x[torch.from_numpy(new)], kp, vp, prefix, lens, key_times, qtimes[new])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for i, (s, n) in enumerate(zip(offsets[:-1], lens)):
        for layer, (k, v) in enumerate(hist.layers):
            torch.testing.assert_close(kp[layer, i, :n], k[s : s + n].flatten(1), atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(vp[layer, i, :n], v[s : s + n].flatten(1), atol=2e-5, rtol=2e-5)


def test_rows_outside_the_buffers_are_refused_before_the_kernel_reads_them():
    """The C++ extend and scorer read and write rows unchecked: a slot map or packed history
    that points past the buffers is refused in Python, naming the rows."""
    from genrec.kernels import hstu_native

    m = model()
    rng = np.random.default_rng(1)
    us = [UserInput(items=rng.integers(1, 60, 9), times=T0 + np.arange(9) * 60, actions=rng.integers(0, 8, 9),
                    has_time=True, request_time=T0 + 600)]
    _, state = PackedPath(m, "native").encode(us)
    dense, tower = state.history.native, m.tower.native_weights()
    import dataclasses

    bad = dataclasses.replace(dense, k=list(dense.k), v=list(dense.v), rows=np.arange(9, dtype=np.int64) + 5)
    with pytest.raises(ValueError, match="outside"):
        hstu_native.score(tower, torch.randn(2, 16), bad, torch.tensor([0, 0]))
    c = m.tower.kv_dims()
    pool_k, pool_v = [torch.zeros(20, c.key_width)] * c.layers, [torch.zeros(20, c.value_width)] * c.layers
    slots = np.array([[0, 1, 2, 30]], np.int64)  # the new row's slot past the pool
    with pytest.raises(ValueError, match="outside"):
        m.tower.extend_native(torch.randn(1, 16), pool_k, pool_v, np.array([3]), np.array([4]), None, None, slots)


def test_a_changed_header_builds_its_includers_again(tmp_path, monkeypatch):
    # a library's cache key read only its own source: a change in an included header (bf16.h)
    # would have loaded the stale build
    from genrec.kernels import native

    src = tmp_path / "src"
    src.mkdir()
    (src / "one.h").write_text("inline int one() { return 1; }\n")
    (src / "probe.cpp").write_text('#include "one.h"\nextern "C" int probe() { return one(); }\n')
    monkeypatch.setattr(native, "SOURCES", src)
    monkeypatch.setenv("GENREC_NATIVE_CACHE", str(tmp_path / "cache"))
    native._build.cache_clear()
    try:
        assert native.library("probe").probe() == 1
        (src / "one.h").write_text("inline int one() { return 2; }\n")
        native._build.cache_clear()
        assert native.library("probe").probe() == 2
        assert len(list((tmp_path / "cache").glob("probe-*.so"))) == 2
    finally:
        native._build.cache_clear()
