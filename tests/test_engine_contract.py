"""Every engine keeps the Recommend contract: ``top_k`` items come back, ranked or not.

The proto says ``top_k`` is the number of items to return (0: the server's default, 10, at
most what was retrieved); a call that is not ranked (a retrieval-only model, or the objective
"retrieval") used to get all ``retrieve_k`` it retrieved."""

from __future__ import annotations

import random

import numpy as np
import pytest

from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.client import user
from genrec.serve.engine import NaiveTorchEngine, TorchEngine
from genrec.serve.requests import DEFAULT_TOP_K, Limits, decode
from tests.serving_helpers import untrained_artifact

T0 = 1_700_000_000
RETRIEVE_K = 100


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("contract")
    return {"ranked": untrained_artifact(out / "ranked"), "retrieval": untrained_artifact(out / "retrieval", ranking=False)}


def _torch(kind: str, artifact):  # noqa: ANN001, ANN202 - one of the in-process torch engines
    from genrec.kernels.hstu_native import library

    if kind == "native" and library() is None:
        pytest.skip("no C++ compiler: the native kernels did not build")
    return {"native": lambda: TorchEngine(artifact, native=True),
            "packed": lambda: TorchEngine(artifact, native=False),
            "cached": lambda: TorchEngine(artifact, kv_cache_mb=4, cache_reuse="always"),
            "jagged": lambda: TorchEngine(artifact, padded=False),
            "naive": lambda: NaiveTorchEngine(artifact)}[kind]()


def history(n: int, seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 200), T0 + 60 * i, rng.choice([1, 3])) for i in range(n)]


def recommend_bytes(top_k: int, objective: str = "", seed: int = 0) -> bytes:
    u = user(history(6 + seed, seed), {"region": [seed % 5]})
    u.user_id = f"u{seed}"
    return pb.RecommendRequest(user=u, retrieve_k=RETRIEVE_K, top_k=top_k, objective=objective).SerializeToString()


def expected(top_k: int) -> int:
    return top_k or min(DEFAULT_TOP_K, RETRIEVE_K)


TOP_KS = [0, 1, 5, 10, 37]


def check_top_k(engine, ranked: bool) -> None:  # noqa: ANN001 - any engine
    """Recommend returns ``top_k`` items (0: the default) whether or not it is ranked, in the
    order of the value it is ranked by; Retrieve returns ``k``."""
    objectives = ["", "retrieval", "click", "ecpm"] if ranked else ["", "retrieval"]
    cases = [(k, o) for k in TOP_KS for o in objectives]
    works = [decode("recommend", recommend_bytes(k, o, seed), engine.schema, Limits())
             for seed, (k, o) in enumerate(cases)]
    retrieve = pb.RetrieveRequest(user=user(history(7, 9)), k=RETRIEVE_K).SerializeToString()
    works.append(decode("retrieve", retrieve, engine.schema, Limits()))
    results = engine.run(works)
    assert len(results) == len(works)
    for (k, o), r in zip(cases, results):
        assert r.item_ids.size == r.scores.size == expected(k), (o, k, r.item_ids.size)
        assert np.all(np.diff(r.scores) <= 0), "best first"
        assert np.unique(r.item_ids).size == r.item_ids.size
    assert results[-1].item_ids.size == RETRIEVE_K  # Retrieve: k, untouched


@pytest.mark.parametrize("model", ["ranked", "retrieval"])
@pytest.mark.parametrize("kind", ["native", "packed", "cached", "jagged", "naive"])
def test_recommend_returns_top_k_items_ranked_or_not(artifacts, model, kind):
    check_top_k(_torch(kind, artifacts[model]), model == "ranked")


def test_top_k_zero_is_the_default_and_unranked_calls_keep_the_retrieval_order(artifacts):
    """top_k 0 decodes to the default; an unranked call's items are the head of its retrieval."""
    engine = TorchEngine(artifacts["retrieval"])
    data = recommend_bytes(0)
    w = decode("recommend", data, engine.schema, Limits())
    assert w.top_k == DEFAULT_TOP_K
    got = engine.run([w])[0]
    req = pb.RecommendRequest.FromString(data)
    full = engine.run([decode("retrieve", pb.RetrieveRequest(user=req.user, k=RETRIEVE_K).SerializeToString(),
                              engine.schema, Limits())])[0]
    np.testing.assert_array_equal(got.item_ids, full.item_ids[:DEFAULT_TOP_K])
    np.testing.assert_allclose(got.scores, full.scores[:DEFAULT_TOP_K])
