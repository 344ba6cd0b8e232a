"""The engine's packed path (serve.engine.PackedPath) on either tower backend computes what the
model's batch path computes."""

import numpy as np
import pytest
import torch

from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.kernels.hstu_native import library as native_library
from genrec.models.hstu import HSTUConfig
from genrec.models.ranking import RankingConfig, TaskConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.serve.engine import collate_users
from genrec.serve.packed import PackedPath
from genrec.serve.packed import packed_supports as supports
from genrec.serve.requests import UserInput

TASKS = (TaskConfig("click", ("click",)), TaskConfig("conversion", ("conversion",)))
T0 = 1_700_000_000


def model(heads=1, time_bias=True, position_bias=True, layers=2, encoding="summed", tower="hstu"):
    torch.manual_seed(0)
    tables = (TableConfig("item", ("item",), dim=16, num_embeddings=60),
              TableConfig("action", ("action",), dim=16, num_embeddings=8),
              TableConfig("region", ("region",), dim=4, num_embeddings=5, pooling="sum"))
    hstu = HSTUConfig(num_layers=layers, num_heads=heads, qk_dim=16 // heads, v_dim=16 // heads, dropout=0.0,
                      time_bias=time_bias, position_bias=position_bias, num_time_buckets=16)
    cfg = ModelConfig(tower=tower, max_seq_len=24, input_dropout=0.0, hstu=hstu,
                      ranking=RankingConfig(tasks=TASKS, encoding=encoding, dropout=0.0))
    m = GenerativeRecommender(cfg, EmbeddingConfig(tables=tables), torch.arange(1, 60)).eval()
    with torch.no_grad():  # biases big enough to matter
        for layer in m.tower.layers:
            for p in (getattr(layer, "pos_weights", None), getattr(layer, "time_weights", None)):
                if p is not None:
                    p.normal_(0, 1.0)
    return m


def users(seed=0):
    """Histories of 1 to 40 events (longer than the tower takes: cut to the last 23), with
    and without timestamps, ties and long gaps in time."""
    rng = np.random.default_rng(seed)
    out = []
    for r, n in enumerate((5, 1, 40, 12, 23, 2)):
        times = T0 + np.cumsum(rng.choice([0, 1, 60, 86_400, 10**7], n))
        out.append(UserInput(items=rng.integers(1, 60, n), times=times, actions=rng.integers(0, 8, n),
                             has_time=r % 3 != 1, request_time=int(times[-1]) + 30, context={"region": np.array([r % 5])}))
    return out


def reference(m, us, cands):
    """User vectors and candidate probabilities through the model's jagged path."""
    with torch.inference_mode():
        vec, state = m.encode_history(collate_users(us, m, torch.device("cpu")))
        owner = torch.cat([torch.full((c.size,), i) for i, c in cands])
        items = torch.from_numpy(np.concatenate([c for _, c in cands]))
        return vec, m.score_candidates(state, items, owner)


def padded_scores(path, hist, cands):
    return torch.from_numpy(np.concatenate(path.score(hist, [i for i, _ in cands], [c for _, c in cands])))


# candidates per user (ragged, users out of order, one user without any)
CANDS = [(3, np.array([4, 9, 17])), (0, np.array([2])), (5, np.array([30, 31, 32, 33, 34])), (1, np.array([7, 8])),
         (2, np.array([50, 51, 52, 53]))]


@pytest.mark.parametrize("kind", ["torch", "native"])
@pytest.mark.parametrize("heads,time_bias,position_bias,layers", [
    (1, True, True, 2), (2, True, True, 3), (1, False, True, 2), (1, True, False, 1)])
def test_serving_paths_equal_the_jagged_model_path(monkeypatch, kind, heads, time_bias, position_bias, layers):
    """The packed path on the tower's PyTorch and native backends gives the model's numbers."""
    if kind == "native" and native_library() is None:
        pytest.skip("no C++ compiler: the native kernels did not build")
    m = model(heads, time_bias, position_bias, layers)
    us = users()
    vec, probs = reference(m, us, CANDS)
    path = PackedPath(m, kind)
    pvec, hist = path.encode(us)
    torch.testing.assert_close(pvec, vec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded_scores(path, hist, CANDS), probs, atol=1e-5, rtol=1e-5)
    if kind == "native":
        return
    # queries in blocks of 4 rows, candidates scored a user at a time: the same numbers
    monkeypatch.setattr("genrec.kernels.hstu_reference.CAUSAL_BLOCK", 4)
    small = PackedPath(m, kind, micro_batch=1)
    pvec, hist = small.encode(us)
    torch.testing.assert_close(pvec, vec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded_scores(small, hist, CANDS), probs, atol=1e-5, rtol=1e-5)


def test_packed_path_in_bf16_matches_the_jagged_bf16_path():
    m = model()
    for part in (m.tower, m.pos_emb, m.ranking):
        part.to(torch.bfloat16)
    us = users(1)
    vec, probs = reference(m, us, CANDS)
    path = PackedPath(m)
    pvec, hist = path.encode(us)
    assert pvec.dtype == torch.float32
    torch.testing.assert_close(pvec, vec, atol=0.02, rtol=0.02)
    torch.testing.assert_close(padded_scores(path, hist, CANDS), probs, atol=0.01, rtol=0.01)


def test_only_models_it_computes_take_the_packed_path():
    assert supports(model())
    assert not supports(model(tower="transformer"))
    assert not supports(model(encoding="interleaved"))
    with pytest.raises(ValueError, match="summed action encoding"):
        PackedPath(model(encoding="interleaved"))
    with pytest.raises(ValueError, match="at least one history event"):
        PackedPath(model()).encode([UserInput(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                              True, T0)])


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_a_retrieval_only_model_without_actions_encodes_alike(kind):
    """The README's ML-1M serving artifact: item table only, no ranking tasks."""
    if kind == "native" and native_library() is None:
        pytest.skip("no C++ compiler: the native kernels did not build")
    torch.manual_seed(0)
    cfg = ModelConfig(tower="hstu", max_seq_len=24, input_dropout=0.0,
                      hstu=HSTUConfig(num_layers=2, qk_dim=16, v_dim=16, dropout=0.0, num_time_buckets=16))
    m = GenerativeRecommender(cfg, EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=16, num_embeddings=60),)),
                              torch.arange(1, 60)).eval()
    assert m.ranking is None and supports(m)
    us = users(2)
    with torch.inference_mode():
        vec, _ = m.encode_history(collate_users(us, m, torch.device("cpu")))
    path = PackedPath(m, kind)
    pvec, hist = path.encode(us)
    torch.testing.assert_close(pvec, vec, atol=1e-5, rtol=1e-5)
    assert hist.context is None
    with pytest.raises(ValueError, match="no ranking tasks"):
        path.score(hist, [0], [np.array([1, 2])])
