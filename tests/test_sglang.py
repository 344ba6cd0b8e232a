"""The SGLang engine against the PyTorch engine: same artifact, same requests, same answers.

Runs in CI on CPU (SGLang's torch-native path); SGLang is part of the set-up (.ci/setup).
"""

from __future__ import annotations

import numpy as np
import pytest

from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.client import user
from genrec.serve.engine import TorchEngine
from genrec.serve.requests import Limits, decode
from tests.serving_helpers import ThreadedServer, tiny_ranking_artifact

TOL = 1e-5  # the towers run the same fp32 code; differences are summation order only


@pytest.fixture(scope="module")
def artifacts(tiny_synth, tmp_path_factory):
    out = tmp_path_factory.mktemp("sgl")
    return {t: tiny_ranking_artifact(tiny_synth, out, tower=t) for t in ("hstu", "transformer")}


def works(schema, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(6):
        n = int(rng.integers(1, 25))
        hist = [(int(rng.integers(1, 600)), 1_700_000_000 + 90 * j, int(rng.choice([1, 3, 7]))) for j in range(n)]
        u = user(hist, {"region": [i % 5]})
        if i % 3 == 0:
            req, kind = pb.RecommendRequest(user=u, retrieve_k=25, top_k=8), "recommend"
        elif i % 3 == 1:
            cands = [pb.Candidate(item_id=int(c), bid=float(b)) for c, b in zip(rng.integers(1, 600, 12), rng.random(12))]
            req, kind = pb.RankRequest(user=u, candidates=cands, objective="ecpm"), "rank"
        else:
            req, kind = pb.RetrieveRequest(user=u, k=15), "retrieve"
        out.append(decode(kind, req.SerializeToString(), schema, Limits()))
    return out


@pytest.mark.parametrize("tower", ["hstu", "transformer"])
def test_sglang_and_torch_engines_return_the_same_scores(artifacts, tower):
    from genrec.serve.sglang_engine import SGLangEngine

    torch_engine = TorchEngine(artifacts[tower])
    sgl_engine = SGLangEngine(artifacts[tower])
    try:
        batch = works(torch_engine.schema, seed=1)
        for a, b in zip(torch_engine.run(batch), sgl_engine.run(batch)):
            np.testing.assert_array_equal(a.item_ids, b.item_ids)
            np.testing.assert_allclose(a.scores, b.scores, rtol=TOL, atol=TOL)
            for t in a.tasks:
                np.testing.assert_allclose(a.tasks[t], b.tasks[t], rtol=TOL, atol=TOL)
    finally:
        sgl_engine.close()


def test_sglang_engine_behind_the_grpc_server(artifacts):
    from genrec.serve.sglang_engine import SGLangEngine

    engine = SGLangEngine(artifacts["hstu"])
    srv = ThreadedServer(artifacts["hstu"], engine=engine)
    try:
        c = srv.client(timeout_s=30)
        u = user([(5, 1_700_000_000, 3), (9, 1_700_000_060, 1)], {"region": [2]})
        rec = c.recommend(u, retrieve_k=20, top_k=5)
        assert len(rec.items) == 5 and c.info().engine == "sglang"
        ref = TorchEngine(artifacts["hstu"]).run(
            [decode("recommend", pb.RecommendRequest(user=u, retrieve_k=20, top_k=5).SerializeToString(),
                    engine.schema, Limits())])[0]
        assert [i.item_id for i in rec.items] == ref.item_ids.tolist()
    finally:
        srv.stop()
        engine.close()
