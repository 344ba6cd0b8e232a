"""Ranking at production shape (issue 34): a Rank call of 2,000 candidates over a 4,096-event
history passes the server's default limits and is scored, and the packed path's micro-batches
(which may cut one user's candidates) give the numbers of a single pass."""

import numpy as np
import pytest
import torch

from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.kernels.hstu_native import library as native_library
from genrec.models.hstu import HSTUConfig
from genrec.models.ranking import RankingConfig, TaskConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.engine import schema_of
from genrec.serve.packed import PackedPath, micro_batches
from genrec.serve.requests import InvalidRequest, Limits, UserInput, decode
from genrec.serve.server import ConnectionConfig, _server_options

T0 = 1_700_000_000
HISTORY, CANDIDATES = 4096, 2000  # the production shape the default limits must admit
ITEMS = 500


def long_model() -> GenerativeRecommender:
    """A small ranking HSTU whose window holds the whole 4,096-event history (the candidates sit
    at its last position), with the synthetic ads model's context table."""
    torch.manual_seed(0)
    tables = (TableConfig("item", ("item",), dim=16, num_embeddings=ITEMS),
              TableConfig("action", ("action",), dim=16, num_embeddings=8),
              TableConfig("region", ("region",), dim=8, num_embeddings=64, pooling="sum"))
    hstu = HSTUConfig(num_layers=2, num_heads=1, qk_dim=16, v_dim=16, dropout=0.0, num_time_buckets=16)
    tasks = (TaskConfig("click", ("click",)), TaskConfig("conversion", ("conversion",)))
    cfg = ModelConfig(max_seq_len=HISTORY + 1, input_dropout=0.0, hstu=hstu,
                      ranking=RankingConfig(tasks=tasks, dropout=0.0))
    return GenerativeRecommender(cfg, EmbeddingConfig(tables=tables), torch.arange(1, ITEMS)).eval()


def rank_request(rng: np.random.Generator, history: int = HISTORY, candidates: int = CANDIDATES) -> bytes:
    """A Rank call with one Event message per event (the longer of the two history encodings)."""
    times = T0 + np.cumsum(rng.integers(1, 3600, history))
    events = [pb.Event(item_id=int(i), timestamp=int(t), actions=int(a))
              for i, t, a in zip(rng.integers(1, ITEMS, history), times, rng.integers(0, 8, history))]
    cands = [pb.Candidate(item_id=int(i), bid=float(b))
             for i, b in zip(rng.integers(1, ITEMS, candidates), rng.uniform(0.1, 5.0, candidates))]
    user = pb.User(history=events, context=[pb.ContextFeature(name="region", ids=[7])])
    return pb.RankRequest(user=user, candidates=cands).SerializeToString()


def test_micro_batches_cut_every_candidate_once_in_order_and_evenly():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        counts = rng.integers(0, 30, n) * (rng.random(n) < 0.7)  # some users without any
        size = int(rng.integers(1, 40))
        groups = micro_batches(counts, size)
        pieces = [p for g in groups for p in g]
        # the pieces tile each user's candidates in order, users in order
        flat = [(i, j) for i, s, e in pieces for j in range(s, e)]
        assert flat == [(i, j) for i, c in enumerate(counts) for j in range(c)]
        sizes = [sum(e - s for _, s, e in g) for g in groups]
        assert len(groups) == -(-int(counts.sum()) // size)
        assert all(n <= size for n in sizes) and (not sizes or max(sizes) - min(sizes) <= 1)
        assert all(e > s for _, s, e in pieces) and all(len({i for i, _, _ in g}) == len(g) for g in groups)
    assert micro_batches(np.array([3, 5]), 4) == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)]]
    with pytest.raises(ValueError, match="micro_batch = 0"):
        micro_batches(np.array([3]), 0)


def test_a_rank_call_of_2000_candidates_over_4096_events_passes_the_default_limits():
    schema = schema_of(long_model())
    limits = Limits()
    data = rank_request(np.random.default_rng(1))
    assert len(data) <= limits.request_bytes()
    receive = dict(_server_options(ConnectionConfig(), limits))["grpc.max_receive_message_length"]
    assert len(data) <= receive
    work = decode("rank", data, schema, limits)
    assert work.user.items.size == HISTORY and work.candidates.size == CANDIDATES == work.top_k
    assert schema.max_history == HISTORY  # the model reads every event sent
    with pytest.raises(InvalidRequest, match=rf"^candidates: has {CANDIDATES + 49} candidates; the limit is 2048"):
        decode("rank", rank_request(np.random.default_rng(2), 10, CANDIDATES + 49), schema, limits)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_the_packed_path_scores_it_alike_in_any_micro_batch(backend):
    if backend == "native" and native_library() is None:
        pytest.skip("no C++ compiler: the native kernels did not build")
    m = long_model()
    rng = np.random.default_rng(3)
    work = decode("rank", rank_request(rng), schema_of(m), Limits())
    short = UserInput(np.array([4, 9, 2]), T0 + np.arange(3), np.array([1, 0, 3]), True, T0 + 9,
                      {"region": np.array([2])})
    # the long call's candidates, a user without candidates, then one sharing the last micro-batch
    users, cands = [0, 1, 2], [work.candidates, np.zeros(0, np.int64), rng.integers(1, ITEMS, 37)]
    whole = PackedPath(m, backend, micro_batch=10**6)
    _, state = whole.encode([work.user, short, short])
    expect = whole.score(state, users, cands)
    assert [p.shape for p in expect] == [(CANDIDATES, 2), (0, 2), (37, 2)]
    assert all(np.isfinite(p).all() for p in expect)
    for mb in (512, 777):  # the long user's candidates cut in 4 and 3 pieces
        got = PackedPath(m, backend, micro_batch=mb).score(state, users, cands)
        for g, e in zip(got, expect):
            np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_bf16_candidate_scoring_ranks_the_call_as_fp32_does(backend):
    """score_backend "torch-bf16" (TorchEngine(candidate_precision="bf16")) against the fp32
    scores of the same 2,000 x 4,096 call, over the history either backend encoded: the task
    probabilities within 0.01, the eCPM top 100 nearly the same items."""
    if backend == "native" and native_library() is None:
        pytest.skip("no C++ compiler: the native kernels did not build")
    m = long_model()
    work = decode("rank", rank_request(np.random.default_rng(4)), schema_of(m), Limits())
    fp32 = PackedPath(m, backend)
    _, state = fp32.encode([work.user])
    want = fp32.score(state, [0], [work.candidates])[0]
    got = PackedPath(m, backend, score_backend="torch-bf16").score(state, [0], [work.candidates])[0]
    np.testing.assert_allclose(got, want, atol=1e-2)
    top = lambda p: set(np.argsort(-(p[:, 0] * p[:, 1]))[:100].tolist())  # noqa: E731
    assert len(top(got) & top(want)) >= 90


def test_auto_precision_scores_small_calls_on_the_fp32_kernel_and_large_ones_in_bf16(monkeypatch):
    """candidate_precision "auto" beside the native kernel: a micro-batch of fewer candidate x
    history pairs than ``score_from`` takes the fp32 native backend (bf16 loses there: 0.4-0.6x
    at the serving shape), a larger one the bf16 GEMMs."""
    if native_library() is None:
        pytest.skip("no C++ compiler: the native kernels did not build")
    m = long_model()
    rng = np.random.default_rng(5)
    work = decode("rank", rank_request(rng, history=300, candidates=40), schema_of(m), Limits())
    path = PackedPath(m, "native", score_backend="torch-bf16", score_from=300 * 100)
    _, state = path.encode([work.user])
    used = []
    extend = m.extend
    monkeypatch.setattr(m, "extend", lambda st, x, owner, backend: used.append(backend) or extend(st, x, owner, backend))
    path.score(state, [0], [work.candidates])  # 300 x 40 pairs
    path.score(state, [0], [np.tile(work.candidates, 3)])  # 300 x 120
    assert used == ["native", "torch-bf16"]


def test_the_engine_s_auto_precision_keeps_small_calls_on_the_native_kernel(tmp_path):
    from genrec.config import to_dict
    from genrec.quant.artifact import Manifest, save_artifact
    from genrec.quant.dense import dense_tensors
    from genrec.quant.embeddings import table_tensors
    from genrec.serve.engine import TorchEngine, bf16_gemm_fast
    from genrec.serve.packed import BF16_FROM_PAIRS

    if native_library() is None or not bf16_gemm_fast(torch.device("cpu")):
        pytest.skip("needs the native kernels and a CPU with fast bf16")
    m = long_model()
    art = save_artifact(tmp_path / "art", Manifest(to_dict(m.cfg), to_dict(m.embedding_cfg),
                                                   {"embeddings": "fp32", "dense": "fp32", "row_alignment": 16}),
                        {"embeddings.safetensors": table_tensors(m.sparse, "fp32"),
                         "dense.safetensors": dense_tensors(m, "fp32")})
    auto, bf16 = (TorchEngine(art, candidate_precision=p).packed for p in ("auto", "bf16"))
    assert auto is not None and bf16 is not None
    assert (auto.backend, auto.score_backend, auto.score_from) == ("native", "torch-bf16", BF16_FROM_PAIRS)
    assert bf16.score_from == 0  # asked for: every call in bf16


def test_auto_candidate_precision_follows_the_cpu():
    from genrec.serve.engine import bf16_gemm_fast

    assert bf16_gemm_fast(torch.device("cpu")) == bool(torch.cpu._is_avx512_bf16_supported()
                                                       or torch.cpu._is_amx_tile_supported())
    assert not bf16_gemm_fast(torch.device("meta"))
