"""The torch engine's per-user K/V cache (serve.kvcache): a cached engine answers as the same
engine without a cache (within 1e-5) while encoding only what the cache does not hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from genrec.config import to_dict
from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.kernels.hstu_bounded import BlockSums
from genrec.kernels.hstu_native import library as native_library
from genrec.models.hstu import HSTUConfig
from genrec.models.ranking import RankingConfig, TaskConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.quant.artifact import Manifest, save_artifact
from genrec.quant.dense import dense_tensors
from genrec.quant.embeddings import table_tensors
from genrec.serve.engine import Result, TorchEngine
from genrec.serve.kvcache import CacheConfig, Entry, KVCache, common_prefix
from genrec.serve.metrics import ServerMetrics
from genrec.serve.packed import room
from genrec.serve.requests import UserInput, Work

T0 = 1_700_000_000
ITEMS = 200
WINDOW = 64  # the model's history window (max_seq_len - 1)
TASKS = (TaskConfig("click", ("click",)), TaskConfig("conversion", ("conversion",)))
BACKENDS = ["torch", "native"]


def _artifact(out: Path, layers: int = 2, window: int = 0, summary_block: int = 64) -> Path:
    """A small untrained HSTU ranking model (2 heads, visible biases) written as an fp32 artifact
    (``window`` > 0: the bounded long-history tower, with block summaries of ``summary_block``)."""
    torch.manual_seed(0)
    tables = (TableConfig("item", ("item",), dim=16, num_embeddings=ITEMS + 1),
              TableConfig("action", ("action",), dim=16, num_embeddings=8),
              TableConfig("region", ("region",), dim=8, num_embeddings=5, pooling="sum"))
    hstu = HSTUConfig(num_layers=layers, num_heads=2, qk_dim=8, v_dim=8, dropout=0.0, num_time_buckets=16,
                      window=window, summary_block=summary_block)
    cfg = ModelConfig(tower="hstu", max_seq_len=WINDOW + 1, input_dropout=0.0, hstu=hstu,
                      ranking=RankingConfig(tasks=TASKS, dropout=0.0))
    emb = EmbeddingConfig(tables=tables)
    m = GenerativeRecommender(cfg, emb, torch.arange(1, ITEMS + 1)).eval()
    with torch.no_grad():  # biases big enough to matter
        for layer in m.tower.layers:
            layer.pos_weights.normal_(0, 1.0)
            layer.time_weights.normal_(0, 1.0)
    manifest = Manifest(model=to_dict(cfg), embedding=to_dict(emb),
                        quantization={"embeddings": "fp32", "dense": "fp32", "row_alignment": 16})
    return save_artifact(out, manifest, {"embeddings.safetensors": table_tensors(m.sparse, "fp32"),
                                         "dense.safetensors": dense_tensors(m, "fp32")})


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return _artifact(tmp_path_factory.mktemp("kv") / "art")


def _engines(artifact: Path, backend: str, mb: float = 64.0, block: int = 1) -> tuple[TorchEngine, TorchEngine]:
    if backend == "native" and native_library() is None:
        pytest.skip("no C++ compiler: the native kernels did not build")
    native = backend == "native"
    ref = TorchEngine(artifact, native=native, window_block=block)
    cached = TorchEngine(artifact, native=native, kv_cache_mb=mb, window_block=block)
    assert cached.path == ref.path == ("native" if native else "packed")
    return ref, cached


def history(n: int, seed: int, has_time: bool = True) -> UserInput:
    rng = np.random.default_rng(seed)
    times = T0 + np.cumsum(rng.choice([0, 1, 60, 3_600, 86_400], n))
    return UserInput(items=rng.integers(1, ITEMS, n), times=times, actions=rng.integers(0, 8, n), has_time=has_time,
                     request_time=int(times[-1]) + 30, context={"region": np.array([seed % 5])})


def grown(u: UserInput, k: int, seed: int) -> UserInput:
    """``u`` with ``k`` more events after its last, asked for after them."""
    rng = np.random.default_rng(seed)
    times = int(u.times[-1]) + np.cumsum(rng.integers(1, 5_000, k))
    return UserInput(items=np.concatenate([u.items, rng.integers(1, ITEMS, k)]), times=np.concatenate([u.times, times]),
                     actions=np.concatenate([u.actions, rng.integers(0, 8, k)]), has_time=u.has_time,
                     request_time=int(times[-1]) + 30, context=u.context, user_id=u.user_id)


def named(u: UserInput, user_id: str, request_time: int | None = None) -> UserInput:
    return UserInput(u.items, u.times, u.actions, u.has_time, u.request_time if request_time is None else request_time,
                     u.context, user_id)


CANDIDATES = np.arange(1, ITEMS, 7)


def works(users: list[UserInput]) -> list[Work]:
    """Per user: a Rank of the same candidates (task probabilities in candidate order) and a
    Retrieve of the whole catalogue (the user vector's score of every item)."""
    out = []
    for u in users:
        out.append(Work("rank", u, candidates=CANDIDATES, candidate_ids=CANDIDATES, bids=np.ones(CANDIDATES.size)))
        out.append(Work("retrieve", u, retrieve_k=ITEMS, exclude_history=False))
    return out


def assert_same(got: list[Result], want: list[Result]) -> None:
    for g, w in zip(got, want, strict=True):
        if w.tasks:
            np.testing.assert_array_equal(g.item_ids, w.item_ids)
            for t in w.tasks:
                np.testing.assert_allclose(g.tasks[t], w.tasks[t], atol=1e-5, rtol=1e-5)
        else:  # by item: near-ties may swap places
            order_g, order_w = np.argsort(g.item_ids), np.argsort(w.item_ids)
            np.testing.assert_array_equal(g.item_ids[order_g], w.item_ids[order_w])
            np.testing.assert_allclose(g.retrieval_scores[order_g], w.retrieval_scores[order_w], atol=1e-5, rtol=1e-5)


def run_both(ref: TorchEngine, cached: TorchEngine, users: list[UserInput]) -> list[Result]:
    """Both engines on the same batch; the cached engine's results (equal to the reference's)."""
    got, want = cached.run(works(users)), ref.run(works(users))
    assert_same(got, want)
    for g, w in zip(got, want):
        assert g.history_tokens == w.history_tokens
    return got[::2]  # one per user (its Retrieve is looked up after its Rank: same user, same batch)


class TowerCount:
    """Counts the tokens the model pushes through the tower (full encodes, and extends:
    extend_paged, or extend_native on the native backend)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.encoded = self.extended = 0
        m = engine.model
        enc, ext, ext_native = m.encode_history_tokens, m.tower.extend_paged, m.tower.extend_native

        def encode(x, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.encoded += x.shape[0]
            return enc(x, *a, **kw)

        def extend(x, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.extended += x.shape[0]
            return ext(x, *a, **kw)

        def extend_native(x, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.extended += x.shape[0]
            return ext_native(x, *a, **kw)

        m.encode_history_tokens, m.tower.extend_paged, m.tower.extend_native = encode, extend, extend_native

    def take(self) -> tuple[int, int]:
        out = (self.encoded, self.extended)
        self.encoded = self.extended = 0
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_cold_warm_grown_and_retimed_calls_equal_the_engine_without_cache(artifact, backend):
    ref, cached = _engines(artifact, backend)
    count = TowerCount(cached)
    u = named(history(12, seed=1), "alice")
    # cold: everything encoded, nothing reused; kept (both works of the user: the last one's entry)
    r = run_both(ref, cached, [u])[0]
    assert (r.history_tokens, r.cached_tokens, r.cache_lookup) == (12, 0, True)
    assert count.take() == (24, 0)  # (the Rank and the Retrieve of the user: one batch, both cold)
    # the same call again: all but the last event reused; only that one token goes through the tower
    got = cached.run(works([u])[:1])
    assert_same(got, ref.run(works([u])[:1]))
    assert (got[0].cached_tokens, count.take()) == (11, (0, 1))
    # a later request time: the last event's query time changed, the rest did not
    later = named(u, "alice", u.request_time + 3_600)
    assert [r.cached_tokens for r in run_both(ref, cached, [later])] == [11]
    count.take()
    # 1, 5 and 50 more events (to 68: past the window of 64, which slides: nothing to reuse)
    for k, reused in ((1, 11), (5, 12), (50, 0)):
        before = later
        later = grown(later, k, seed=k)
        got = cached.run(works([later])[:1])
        assert_same(got, ref.run(works([later])[:1]))
        assert got[0].cached_tokens == reused and got[0].history_tokens == min(later.items.size, WINDOW)
        new = got[0].history_tokens - reused
        assert count.take() == ((new, 0) if reused == 0 else (0, new)), (k, before.items.size)
    stats = cached.cache_stats()
    assert stats["users"] == 1 and stats["used_tokens"] == WINDOW and stats["hits"] >= 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_fifty_events_appended_within_the_window(artifact, backend):
    ref, cached = _engines(artifact, backend)
    count = TowerCount(cached)
    timed, untimed = named(history(10, seed=2), "bob"), named(history(10, seed=3, has_time=False), "carl")
    run_both(ref, cached, [timed, untimed])
    count.take()
    more = [grown(timed, 50, seed=3), grown(untimed, 50, seed=4)]
    # without timestamps a token is queried at its position + 1, not at the next event's time: the
    # last cached event's keys / values still hold
    assert [r.cached_tokens for r in run_both(ref, cached, more)] == [9, 10]
    assert count.take() == (0, 2 * (51 + 50))  # (Rank and Retrieve of each, one batch: both found the cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mixed_batch_warm_users_of_different_lengths_cold_ones_and_no_user_id(artifact, backend):
    ref, cached = _engines(artifact, backend)
    a, b, c = named(history(30, 4), "a"), named(history(3, 5), "b"), named(history(9, 6), "c")
    run_both(ref, cached, [a, b, c])
    anon = history(17, 7)
    batch = [grown(a, 5, 8), named(history(8, 9), "new"), anon, grown(b, 30, 10),
             named(c, "c", c.request_time + 1)]
    got = run_both(ref, cached, batch)
    assert [r.cached_tokens for r in got] == [29, 0, 0, 2, 8]
    assert [r.cache_lookup for r in got] == [True, True, False, True, True]
    assert cached.cache_stats()["users"] == 4  # a, b, c, new; not the call without a user_id


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_history_keeps_its_prefix_until_the_window_moves_a_block(artifact, backend):
    ref, cached = _engines(artifact, backend, block=8)
    u = named(history(70, seed=11), "long")  # the window starts at 8 (the multiple of 8 leaving <= 64): 62 events
    assert [r.history_tokens for r in run_both(ref, cached, [u])] == [62]
    u = grown(u, 2, seed=12)  # 72 events: the window still starts at 8
    assert [(r.history_tokens, r.cached_tokens) for r in run_both(ref, cached, [u])] == [(64, 61)]
    u = grown(u, 1, seed=13)  # 73: the window moves to 16 (57 events): the cached prefix is gone
    assert [(r.history_tokens, r.cached_tokens) for r in run_both(ref, cached, [u])] == [(57, 0)]
    u = grown(u, 1, seed=14)
    assert [(r.history_tokens, r.cached_tokens) for r in run_both(ref, cached, [u])] == [(58, 56)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_eviction_under_a_tiny_budget_keeps_results_equal_and_memory_bounded(artifact, backend):
    ref, cached = _engines(artifact, backend, mb=28 / 1024)  # 28 KiB
    capacity = cached.cache_stats()["capacity_tokens"]
    assert capacity == 28 * 1024 // cached.cache.token_bytes and 64 < capacity < 128  # one full window, not two
    users = [named(history(n, seed), f"u{seed}") for seed, n in enumerate((50, 40, 64, 20, 53, 64))]
    evicted = 0
    for round_ in range(2):
        for u in users:
            got = run_both(ref, cached, [grown(u, round_, seed=99)] if round_ else [u])
            evicted += got[0].evicted_tokens
            stats = cached.cache_stats()
            assert stats["bytes"] <= 28 * 1024 and stats["used_tokens"] <= capacity
    assert evicted > 0 and cached.cache_stats()["evicted_tokens"] == evicted
    big = _engines(artifact, backend, mb=16 / 1024)[1]  # fits no full window: nothing kept, still right
    got = big.run(works([users[2]]))
    assert_same(got, ref.run(works([users[2]])))
    assert big.cache_stats()["users"] == 0 and got[1].cached_tokens == 0


def test_the_native_backend_reuses_short_windows_and_mostly_new_ones(artifact):
    """On the native backend a cached prefix is reused whatever the window's length and however
    many tokens are new: its extend is the C++ kernel (before, PyTorch ops whose fixed cost made
    the encode of a short window cheaper, so such windows were encoded whole)."""
    if native_library() is None:
        pytest.skip("no C++ compiler: the native kernels did not build")
    ref, cached = TorchEngine(artifact), TorchEngine(artifact, kv_cache_mb=1)
    assert cached.path == "native"
    u = named(history(30, 1), "short")
    for want in (0, 29):  # the second call: all but the last event from the cache
        got = cached.run(works([u])[:1])
        assert_same(got, ref.run(works([u])[:1]))
        assert (got[0].cached_tokens, got[0].cache_lookup) == (want, True)
    more = history(30, 2)  # as many events again, after the first 30: half of the window new
    grown = named(UserInput(items=np.concatenate([u.items, more.items]),
                            times=np.concatenate([u.times, more.times - more.times[0] + u.times[-1] + 60]),
                            actions=np.concatenate([u.actions, more.actions]), has_time=True,
                            request_time=int(more.times[-1] - more.times[0] + u.times[-1] + 90), context=u.context),
                  "short")
    got = cached.run(works([grown])[:1])
    assert_same(got, ref.run(works([grown])[:1]))
    assert got[0].cached_tokens == 29
    s = cached.cache_stats()
    assert (s["hits"], s["misses"], s["users"]) == (2, 1, 1)


def test_lru_evicts_the_least_recently_used_user():
    def entry(n: int) -> Entry:
        z = np.arange(n)
        return Entry(z, z, z, z + 1, torch.zeros(1, n, 2), torch.zeros(1, n, 2))

    cache = KVCache(budget_bytes=100 * 10, token_bytes=10)  # 100 tokens
    assert cache.put("a", entry(40)) == 0 and cache.put("b", entry(40)) == 0
    ev = np.arange(41)
    assert cache.lookup("a", (ev, ev, ev, ev + 1))[1] == 40  # a used: b is now the oldest
    assert cache.put("c", entry(40)) == 40
    assert list(cache.entries) == ["a", "c"]
    assert cache.put("a", entry(60)) == 0  # a's own entry replaced, not evicted: 60 + 40 fit
    assert cache.put("a", entry(61)) == 40  # ... 61 + 40 do not: c made room
    assert list(cache.entries) == ["a"] and cache.used_tokens == 61
    assert cache.put("d", entry(101)) == 0 and "d" not in cache.entries  # larger than the budget
    assert cache.put("a", entry(101)) == 0 and not cache.entries  # ... and the user's old one is gone too
    s = cache.stats()
    assert (s["hits"], s["misses"], s["evicted_tokens"], s["capacity_tokens"], s["bytes"]) == (1, 0, 80, 100, 0)


def test_an_entry_whose_room_to_grow_does_not_fit_is_kept_without_it():
    """A warm call grows a user's storage with room for more tokens; where the tokens fit the
    budget and the room does not, the entry is kept compact (else every other call of a growing
    user would miss)."""
    z = np.arange(60)
    ks, vs = torch.randn(1, 80, 2), torch.randn(1, 80, 2)  # storage for 80 tokens, 60 used
    grown_entry = Entry(z, z, z, z + 1, ks[:, :60], vs[:, :60], room=(ks, vs))
    cache = KVCache(budget_bytes=70 * 10, token_bytes=10)  # 70 tokens
    assert grown_entry.held == 80 and cache.put("a", grown_entry) == 0
    kept = cache.entries["a"]
    assert kept.room is None and kept.held == cache.used_tokens == 60
    assert torch.equal(kept.k, ks[:, :60]) and kept.k.untyped_storage().nbytes() == 60 * 2 * 4


def test_block_summaries_are_charged_and_dropped_where_only_they_do_not_fit():
    def entry(n: int, blocks: int) -> Entry:
        z = np.arange(n)
        sums = [BlockSums(torch.zeros(blocks, 1, 1), torch.zeros(blocks, 1, 1))]  # 8 bytes a block
        return Entry(z, z, z, z + 1, torch.zeros(1, n, 2), torch.zeros(1, n, 2), sums=sums)

    cache = KVCache(budget_bytes=100 * 10, token_bytes=10)  # 100 tokens: 1,000 bytes
    assert cache.put("a", entry(40, 25)) == 0 and cache.stats()["bytes"] == 400 + 200
    assert cache.used_tokens == 60
    assert cache.put("b", entry(30, 30)) == 40  # 600 + 540 > 1,000 (its tokens alone, 700, would fit)
    assert list(cache.entries) == ["b"] and cache.stats()["bytes"] == 540
    assert cache.put("c", entry(90, 5)) == 30 and cache.entries["c"].sums is not None  # 940 fits, b goes
    assert cache.put("c", entry(95, 10)) == 0 and cache.entries["c"].sums is None  # 1,030: kept without sums
    assert cache.stats()["bytes"] == 950 and cache.used_tokens == 95
    assert cache.put("c", entry(101, 0)) == 0 and not cache.entries and cache.stats()["bytes"] == 0


@pytest.mark.parametrize("layers", [1, 2])
def test_each_entry_of_a_warm_batch_holds_only_its_own_tokens(tmp_path, layers):
    """Warm users extended together: each kept entry owns storage of its own tokens only, never a
    view of the batch's buffer (which a one-layer slice would be, and which would keep every
    user's padded rows alive beyond what the budget counts)."""
    eng = TorchEngine(_artifact(tmp_path / "art", layers), native=False, kv_cache_mb=64)
    us = [named(history(n, seed=i), f"u{i}") for i, n in enumerate([60, 5, 5, 5])]
    eng.run(works(us))
    eng.run(works([grown(u, 1, seed=100 + i) for i, u in enumerate(us)]))
    assert len(eng.cache.entries) == 4
    for e in eng.cache.entries.values():
        for t in (e.k, e.v):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _held_bytes(e: Entry) -> tuple[int, int]:
    """(bytes an entry's storage really holds: its keys / values' storage, room included, its
    event arrays and its block summaries' storage; of which the summaries')."""
    seen: set[int] = set()

    def storage(t: torch.Tensor) -> int:
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()

    kv = sum(storage(t) for t in (e.k, e.v, *(e.room or ())))
    sums = sum(storage(t) for s in (e.sums or ()) if s is not None for t in (s.kb, s.vb))
    return kv + sum(getattr(e, f).nbytes for f in ("items", "actions", "times", "query_times")) + sums, sums


def test_a_bounded_towers_block_summaries_count_against_the_budget(tmp_path):
    """A bounded tower's entry also keeps its block summaries (Entry.sums; with a summary block of
    1 almost as large as its keys / values): the budget and the bytes gauge count them, so what
    the cache really holds never exceeds its budget (before, only its tokens were counted: 1.65x
    the budget held while the gauge read below it)."""
    art = _artifact(tmp_path / "art", window=4, summary_block=1)
    ref = TorchEngine(art, native=False)
    cached = TorchEngine(art, native=False, kv_cache_mb=64 / 1024)  # 64 KiB: a few users
    cache = cached.cache
    budget = cache.capacity_tokens * cache.token_bytes
    assert 0 < budget <= 64 * 1024
    evicted, with_sums = 0, 0
    for seed in range(6):
        u = named(history(50, seed=seed), f"u{seed}")
        for call in range(3):  # cold, then warm calls: their entries keep the summaries (and room)
            got = run_both(ref, cached, [grown(u, call, seed=100 + 10 * seed + call) if call else u])
            evicted += got[0].evicted_tokens
            held = [_held_bytes(e) for e in cache.entries.values()]
            real = sum(h for h, _ in held)
            with_sums += sum(s > 0 for _, s in held)
            # the gauge counts every held token's event fields (room included): the arrays hold the tokens'
            room_events = sum(8 * 4 * (e.held - e.tokens) for e in cache.entries.values())
            stats = cache.stats()
            assert real <= stats["bytes"] <= budget, (seed, call, real, stats["bytes"], budget)
            assert stats["bytes"] == real + room_events
            assert stats["used_tokens"] <= stats["capacity_tokens"]
    assert with_sums > 0 and evicted > 0 and cache.stats()["evicted_tokens"] == evicted


def test_common_prefix_stops_at_the_first_difference_and_leaves_the_last_event():
    z = np.arange(10)
    e = Entry(z, z, z, z + 1, torch.zeros(1, 10, 1), torch.zeros(1, 10, 1))
    assert common_prefix(e, (z, z, z, z + 1)) == 9  # identical: the last is encoded again
    assert common_prefix(e, (z[:1], z[:1], z[:1], z[:1] + 1)) == 0
    for field in range(4):
        ev = [z.copy(), z.copy(), z.copy(), z + 1]
        ev[field][4] += 100
        assert common_prefix(e, tuple(ev)) == 4, field
    longer = np.arange(15)
    assert common_prefix(e, (longer, longer, longer, longer + 1)) == 10


def test_no_cache_and_calls_without_user_id_are_todays_engine(artifact):
    off = TorchEngine(artifact, native=False)
    on = TorchEngine(artifact, native=False, kv_cache_mb=1)
    users = [history(10, 1), history(40, 2)]
    a, b = off.run(works(users)), on.run(works(users))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.item_ids, y.item_ids)
        np.testing.assert_array_equal(x.scores, y.scores)  # the very same computation
        assert (y.cached_tokens, y.cache_lookup) == (0, False)
    assert a[0].cache_gauges is None and b[0].cache_gauges == on.cache.gauges()
    assert on.cache_stats()["users"] == 0 and off.cache_stats()["history_tokens"] == 2 * (10 + 40)
    jagged = TorchEngine(artifact, packed=False, kv_cache_mb=1)  # the batch path has no cache: runs without
    named_users = [named(u, f"j{i}") for i, u in enumerate(users)]
    for x, y in zip(jagged.run(works(named_users)), jagged.run(works(named_users))):
        assert (x.cached_tokens, y.cached_tokens, y.cache_lookup) == (0, 0, False)
    assert not jagged.cache.enabled and jagged.cache_stats()["history_tokens"] == 4 * (10 + 40)


def test_the_metrics_count_the_results_and_show_the_gauges(artifact):
    engine = TorchEngine(artifact, kv_cache_mb=1)
    u = named(history(10, 1), "m")
    metrics = ServerMetrics()
    for _ in range(3):
        for r in engine.run(works([u])[:1]):
            metrics.on_result(r)
    text = generate_latest(metrics.registry).decode()
    want = {"genrec_cache_history_tokens_total": 30.0, "genrec_cache_cached_tokens_total": 18.0,
            "genrec_cache_evicted_tokens_total": 0.0, "genrec_cache_hits_total": 2.0,
            "genrec_cache_misses_total": 1.0, "genrec_cache_users": 1.0,
            # its 10 tokens and the room its storage was given when it grew in place (serve.kvcache)
            "genrec_cache_used_tokens": 10.0 + room(10),
            "genrec_cache_capacity_tokens": float(engine.cache_stats()["capacity_tokens"]),
            "genrec_cache_bytes": float(engine.cache_stats()["bytes"])}
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("genrec_cache")}
    assert {k: values.get(k) for k in want} == want


def test_the_cache_config_is_checked():
    with pytest.raises(ValueError, match="kv_cache_mb"):
        CacheConfig(kv_cache_mb=-1)
    with pytest.raises(ValueError, match="window_block"):
        CacheConfig(window_block=0)


def test_an_engine_process_caches_with_the_config_it_was_given(artifact, monkeypatch):
    """[serve.cache] crosses into the engine process (ProcessSettings.cache), and each batch's
    cache accounting crosses back with its results."""
    from genrec.serve.worker import EngineProcess, ProcessSettings

    monkeypatch.setenv("GENREC_NATIVE", "0")  # the torch backend: it reuses the short window's prefix

    engine = EngineProcess("torch", str(artifact), settings=ProcessSettings(threads=1, cache=CacheConfig(kv_cache_mb=1)))
    try:
        u = named(history(10, 1), "p")
        first, again = engine.run(works([u])[:1])[0], engine.run(works([u])[:1])[0]
    finally:
        engine.close()
    assert (first.cached_tokens, again.cached_tokens, again.history_tokens) == (0, 9, 10)
    assert again.cache_gauges["users"] == 1 and again.cache_gauges["capacity_tokens"] > 0


def test_metrics_count_hits_of_an_engine_that_reports_only_its_tokens():
    metrics = ServerMetrics()
    metrics.on_result(Result(np.zeros(0), np.zeros(0), history_tokens=10, cached_tokens=9))
    metrics.on_result(Result(np.zeros(0), np.zeros(0), history_tokens=10))  # not looked up: no miss
    text = generate_latest(metrics.registry).decode()
    assert "genrec_cache_hits_total 1.0" in text and "genrec_cache_misses_total 0.0" in text
    assert "genrec_cache_cached_tokens_total 9.0" in text and "genrec_cache_history_tokens_total 20.0" in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_growing_history_is_extended_in_its_storage_and_never_under_another_call(artifact, backend):
    """A lone call of a warm user writes its new tokens into the entry's storage (not a copy of
    the whole prefix per call: 4 MiB a layer at 8,000 events); while another call of the engine
    runs, it copies instead, so the entry another call may still read is never written."""
    ref, cached = _engines(artifact, backend)
    u = named(history(20, seed=11), "grow")
    rank = lambda x: [Work("rank", x, candidates=CANDIDATES, candidate_ids=CANDIDATES,  # noqa: E731
                           bids=np.ones(CANDIDATES.size))]
    assert_same(cached.run(rank(u)), ref.run(rank(u)))  # cold: the entry is a copy, no room
    storage = []
    for k in range(1, 5):  # grown in place: one new storage with room, then the same one
        u = grown(u, 1, seed=20 + k)
        assert_same(cached.run(rank(u)), ref.run(rank(u)))
        entry = cached.cache.entries["grow"]
        assert entry.room is not None and entry.k.data_ptr() == entry.room[0].data_ptr()
        storage.append(entry.room[0].data_ptr())
    assert len(set(storage)) == 1
    before = cached.cache.entries["grow"]
    kept = before.k.clone(), before.v.clone()
    cached.running += 1  # another call in flight
    try:
        u = grown(u, 1, seed=30)
        assert_same(cached.run(rank(u)), ref.run(rank(u)))
    finally:
        cached.running -= 1
    assert torch.equal(before.k, kept[0]) and torch.equal(before.v, kept[1])  # (not written)
    assert cached.cache.entries["grow"].k.data_ptr() != storage[0]
