"""One suite over every engine (serve.contract.Engine): the in-process torch engine on each of
its paths (native, packed, with its K/V cache, jagged) and the naive baseline; an engine process;
a replica pool; a failover pair; SGLang.

Each engine must satisfy the protocol, keep the Recommend contract (``top_k`` items come back,
ranked or not: the proto says ``top_k`` is the number of items to return, 0 meaning the server's
default of 10; an unranked call used to get all ``retrieve_k`` it retrieved), answer from the
event loop (``run_async``) as from a thread, say what it spent (``stages``), and close twice
without harm. Tiers: each engine's test carries its own (in-process: unit; processes: serving;
SGLang: sglang)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from genrec.benchmarks.naive_engine import NaiveTorchEngine
from genrec.loadtest.client import user
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.contract import Engine
from genrec.serve.engine import TorchEngine
from genrec.serve.requests import DEFAULT_TOP_K, Limits, Work, decode
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
            "cached": lambda: TorchEngine(artifact, kv_cache_mb=4),
            "jagged": lambda: TorchEngine(artifact, packed=False),
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


def check_top_k(engine: Engine, ranked: bool) -> None:
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


# ----- the suite over every engine -----------------------------------------------------------

def _process(artifact: Path) -> Engine:
    from genrec.serve.worker import EngineProcess, ProcessSettings

    return EngineProcess("torch", str(artifact), settings=ProcessSettings(threads=1))


def _pool(artifact: Path) -> Engine:
    from genrec.serve.failover import EnginePool
    from genrec.serve.worker import EngineProcess, ProcessSettings

    return EnginePool([EngineProcess("torch", str(artifact), settings=ProcessSettings(threads=1)) for _ in range(2)])


def _failover(artifact: Path) -> Engine:
    from genrec.serve.failover import FailoverEngine
    from genrec.serve.worker import ProcessSettings

    return FailoverEngine("torch", str(artifact), settings=ProcessSettings(threads=1))


def _sglang(artifact: Path) -> Engine:
    from genrec.serve.sglang_engine import SGLangEngine

    return SGLangEngine(artifact, pool_tokens=4096, threads=1)


# kind -> (build, whether it runs the retrieval-only model too, its tier). Engines in other
# processes run the ranked model only: unranked calls are its objective "retrieval"
ENGINES: dict[str, tuple[Callable[[Path], Engine], bool, str]] = {
    **{k: ((lambda a, k=k: _torch(k, a)), True, "unit") for k in ("native", "packed", "cached", "jagged", "naive")},
    "process": (_process, False, "serving"), "pool": (_pool, False, "serving"), "failover": (_failover, False, "serving"),
    "sglang": (_sglang, True, "sglang"),
}


def _works(schema) -> list[Work]:  # noqa: ANN001
    """A mixed batch: Recommend (ranked and by retrieval), Retrieve, and Rank where there are tasks."""
    out = [decode("recommend", recommend_bytes(5, o, seed), schema, Limits()) for seed, o in enumerate(("", "retrieval"))]
    out.append(decode("retrieve", pb.RetrieveRequest(user=user(history(8, 5)), k=12).SerializeToString(), schema,
                      Limits()))
    if schema.tasks:
        rank = pb.RankRequest(user=user(history(4, 6)), candidates=[pb.Candidate(item_id=i, bid=1.0) for i in (3, 9, 27)])
        out.append(decode("rank", rank.SerializeToString(), schema, Limits()))
    return out


def check_contract(engine: Engine, ranked: bool, reference: TorchEngine) -> None:
    """The protocol's members, top_k, run_async, stages, the same answers as ``reference``, close."""
    assert isinstance(engine, Engine)
    assert engine.name in ("torch", "naive", "sglang") and engine.version == reference.version
    assert engine.schema == reference.schema and engine.tower == "hstu"
    assert engine.manifest.quantization == reference.manifest.quantization
    assert engine.path is None or isinstance(engine.path, str)
    assert isinstance(engine.batches_together, bool) and engine.parallel >= 1
    assert engine.available
    told: list[bool] = []
    engine.on_state(told.append)

    check_top_k(engine, ranked)
    works = _works(engine.schema)
    got = asyncio.run(engine.run_async(works))
    want = reference.run(works)
    assert len(got) == len(works) and all(r.started > 0 for r in got)
    for w, a, b in zip(works, got, want):
        assert a.item_ids.size == b.item_ids.size, w.kind
        if engine.path == reference.path:  # (another path: the same numbers to float rounding, not ties)
            np.testing.assert_array_equal(a.item_ids, b.item_ids)
            np.testing.assert_allclose(a.scores, b.scores, rtol=1e-4, atol=1e-6)
        assert set(a.tasks) == set(b.tasks)
    stages = engine.stages
    assert stages and all(isinstance(k, str) and v >= 0 for k, v in stages.items())

    engine.close()
    engine.close()  # harmless
    assert told == [] or told[-1] is False  # (only a change is told: a wrapper may say it went away)


@pytest.mark.parametrize("kind,model", [
    pytest.param(k, m, marks=getattr(pytest.mark, tier), id=f"{k}-{m}")
    for k, (_, both, tier) in ENGINES.items() for m in (("ranked", "retrieval") if both else ("ranked",))])
def test_every_engine_keeps_the_contract(artifacts, kind, model):
    build = ENGINES[kind][0]
    engine = build(artifacts[model])
    try:
        check_contract(engine, model == "ranked", TorchEngine(artifacts[model]))
    finally:
        engine.close()
