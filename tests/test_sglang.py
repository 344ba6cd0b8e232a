"""The SGLang engine against the PyTorch engine: same artifact, same requests, same answers,
with users' histories cached in SGLang's KV pool (radix cache on) between calls.

Runs in CI on CPU (SGLang's CPU engine); SGLang is part of the set-up (.ci/setup).
"""

from __future__ import annotations

import numpy as np
import pytest

from genrec.loadtest.client import user
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.quant.convert import QuantizeConfig, export
from genrec.serve.engine import TorchEngine
from genrec.serve.requests import Limits, decode
from genrec.train.job import load_job
from genrec.train.loop.launch import run_training
from tests.conftest import tiny_job_overrides
from tests.serving_helpers import RANKING_TOML, ThreadedServer

TOL = 1e-5  # the same fp32 tower; differences are summation order only
T0 = 1_700_000_000


@pytest.fixture(scope="module")
def artifact(tiny_synth, tmp_path_factory):
    """A tiny HSTU ranking artifact with room for 95 history events (appending 50 fits)."""
    out = tmp_path_factory.mktemp("sgl")
    cfg = out / "rank.toml"
    cfg.write_text(RANKING_TOML)
    job = load_job(cfg, tiny_job_overrides(tiny_synth, out / "runs") + ["--train.max_epochs=1", "--model.max_seq_len=96"])
    run_dir, _ = run_training(job)
    art = out / "artifact"
    export(run_dir, art, QuantizeConfig(embeddings="int8"), progress=False)
    return art


@pytest.fixture(scope="module")
def engines(artifact):
    from genrec.serve.sglang_engine import SGLangEngine

    sgl = SGLangEngine(artifact, pool_tokens=8192, threads=1)
    try:
        yield TorchEngine(artifact), sgl
    finally:
        sgl.close()


def history(n: int, seed: int, start: int = 0) -> list[tuple[int, int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(1, 600)), T0 + 90 * (start + j), int(rng.choice([1, 3, 7]))) for j in range(n)]


def work(schema, hist, kind: str, uid: str = "", request_time: int = 0, seed: int = 0):
    rng = np.random.default_rng(seed)
    u = user(hist, {"region": [seed % 5]})
    u.user_id, u.request_time = uid, request_time
    if kind == "recommend":
        req = pb.RecommendRequest(user=u, retrieve_k=25, top_k=8)
    elif kind == "rank":
        cands = [pb.Candidate(item_id=int(c), bid=float(b)) for c, b in zip(rng.integers(1, 600, 12), rng.random(12))]
        req = pb.RankRequest(user=u, candidates=cands, objective="ecpm")
    else:
        req = pb.RetrieveRequest(user=u, k=15)
    return decode(kind, req.SerializeToString(), schema, Limits())


def same(torch_engine, sgl_engine, works) -> list:
    """Runs ``works`` on both engines, checks the answers agree, returns SGLang's results."""
    got = sgl_engine.run(works)
    for a, b in zip(torch_engine.run(works), got):
        np.testing.assert_array_equal(a.item_ids, b.item_ids)
        np.testing.assert_allclose(a.scores, b.scores, rtol=TOL, atol=TOL)
        for t in a.tasks:
            np.testing.assert_allclose(a.tasks[t], b.tasks[t], rtol=TOL, atol=TOL)
    return got


KINDS = ("recommend", "rank", "retrieve")


def test_cold_then_warm_calls_match_and_reuse_all_but_the_last_event(engines):
    te, se = engines
    works = [work(te.schema, history(int(n), seed=i), KINDS[i % 3], uid=f"cold{i}", seed=i)
             for i, n in enumerate([1, 7, 30, 60, 95, 12])]
    cold = same(te, se, works)
    assert [r.cached_tokens for r in cold] == [0] * len(works)
    warm = same(te, se, works)  # the same calls again: every token but the last from the pool
    assert [r.history_tokens for r in warm] == [1, 7, 30, 60, 95, 12]
    assert [r.cached_tokens for r in warm] == [0, 6, 29, 59, 94, 11]
    assert [r.prefilled_tokens for r in warm] == [1, 1, 1, 1, 1, 1]  # what the model's forward computed


@pytest.mark.parametrize("appended", [1, 5, 50])
def test_a_grown_history_prefills_only_its_new_events(engines, appended):
    te, se = engines
    uid = f"grow{appended}"
    base = history(40, seed=appended)
    first = same(te, se, [work(te.schema, base, "rank", uid=uid, seed=1)])[0]
    assert first.prefilled_tokens == 40
    grown = base + history(appended, seed=100 + appended, start=40)
    r = same(te, se, [work(te.schema, grown, "recommend", uid=uid, seed=2)])[0]
    # the old last event was queried at the old request time: it is recomputed with the new events
    assert r.cached_tokens == 39 and r.prefilled_tokens == appended + 1


def test_a_changed_request_time_recomputes_only_the_last_event(engines):
    te, se = engines
    hist = history(30, seed=7)
    same(te, se, [work(te.schema, hist, "rank", uid="time", seed=3)])
    for rt in (T0 + 90 * 29 + 5, T0 + 10**6):
        r = same(te, se, [work(te.schema, hist, "rank", uid="time", request_time=rt, seed=3)])[0]
        assert r.cached_tokens == 29 and r.prefilled_tokens == 1


def test_users_do_not_share_entries_and_calls_without_an_id_are_not_reused(engines):
    te, se = engines
    hist = history(20, seed=11)
    same(te, se, [work(te.schema, hist, "rank", uid="alice", seed=4)])
    assert same(te, se, [work(te.schema, hist, "rank", uid="bob", seed=4)])[0].cached_tokens == 0
    same(te, se, [work(te.schema, hist, "rank", seed=4)])
    assert same(te, se, [work(te.schema, hist, "rank", seed=4)])[0].cached_tokens == 0


def test_a_tiny_pool_evicts_and_chunks_and_recomputes_without_errors(artifact):
    """A pool for ~3 users of 90 events and prefill chunks of 32 tokens: entries are evicted
    and recomputed, long prefills go in chunks (a request's last chunk answers it)."""
    from genrec.serve.sglang_engine import SGLangEngine

    te = TorchEngine(artifact)
    se = SGLangEngine(artifact, pool_tokens=256, chunk_tokens=32, threads=1)
    try:
        users = [history(90, seed=200 + i) for i in range(8)]
        for _ in range(2):  # every user again: most entries were evicted in between
            for i, h in enumerate(users):
                r = same(te, se, [work(te.schema, h, KINDS[i % 3], uid=f"tiny{i}", seed=i)])[0]
                assert r.prefilled_tokens <= 32  # the pass that ended it computed one chunk at most
        stats = se.cache_stats()
        assert stats["capacity_tokens"] == 256 and stats["misses"] > 8
        # entries nobody can match again are evicted first (priority 0 against a user's 1): a user's
        # history survives anonymous calls that overflow the pool (least-recently-used would drop it)
        kept = history(90, seed=999)
        same(te, se, [work(te.schema, kept, "rank", uid="stays", seed=1)])
        for i in range(5):
            same(te, se, [work(te.schema, history(90, seed=900 + i), "rank", seed=i)])  # no user id
        assert same(te, se, [work(te.schema, kept, "rank", uid="stays", seed=1)])[0].cached_tokens == 89
        # several users' chunks in one batch, from several threads
        from concurrent.futures import ThreadPoolExecutor

        batches = [[work(te.schema, users[2 * b + i], "rank", uid=f"tiny{2 * b + i}", seed=i) for i in range(2)]
                   for b in range(3)]
        with ThreadPoolExecutor(3) as pool:
            for batch, got in zip(batches, pool.map(se.run, batches)):
                for a, b in zip(te.run(batch), got):
                    np.testing.assert_allclose(a.scores, b.scores, rtol=TOL, atol=TOL)
    finally:
        se.close()


def test_serve_retrieval_reaches_the_model_process(artifact):
    """[serve.retrieval] configures the SGLang engine's search too: its model process (which
    builds a TorchEngine of its own) probes the lists and re-scores the shortlist it is told, as
    the torch engine configured the same way does, and ModelInfo says which search answers.
    (The model process used to search with the artifact's calibrated values whatever was set.)"""
    from genrec.quant.artifact import read_manifest
    from genrec.serve.ann import RetrievalConfig
    from genrec.serve.sglang_engine import SGLangEngine

    assert read_manifest(artifact).index, "the fixture's artifact was exported with its ANN index"
    narrow = RetrievalConfig(search="ann", nprobe=1, shortlist=20)  # one list: not what calibration chose
    te = TorchEngine(artifact, retrieval=narrow)
    assert te.schema.dense_search.endswith("nprobe=1 shortlist=20")
    assert TorchEngine(artifact).catalogue.ann.nprobe != 1
    se = SGLangEngine(artifact, pool_tokens=4096, threads=1, retrieval=narrow)
    try:
        assert se.schema.dense_search == te.schema.dense_search
        same(te, se, [work(te.schema, history(40, seed=500 + i), kind, seed=i)
                      for i, kind in enumerate(["retrieve", "recommend", "retrieve"])])
    finally:
        se.close()


def test_serve_scoring_reaches_the_model_process(artifact):
    """[serve.scoring] configures the SGLang engine's candidates too: with bf16 its model process
    scores them as the torch engine set to bf16 does, not in fp32 (the SGLang engine used to
    refuse any precision but fp32)."""
    from genrec.serve.sglang_engine import SGLangEngine

    te, fp32 = TorchEngine(artifact, candidate_precision="bf16"), TorchEngine(artifact)
    se = SGLangEngine(artifact, pool_tokens=4096, threads=1, candidate_precision="bf16")
    try:
        works = [work(te.schema, history(n, seed=700 + i), kind, uid=f"bf{i}", seed=i)
                 for i, (n, kind) in enumerate([(40, "rank"), (90, "rank"), (30, "recommend")])]
        for _ in range(2):  # cold, then warm (the history read from the pool)
            got = same(te, se, works)
        moved = max(float(np.abs(a.tasks[t] - b.tasks[t]).max()) for a, b in zip(fp32.run(works), got) for t in a.tasks)
        assert moved > TOL, "the SGLang engine's candidates were scored in fp32"
    finally:
        se.close()


def test_several_batches_in_flight(engines):
    """run() from several threads at once: SGLang batches the requests of all of them."""
    from concurrent.futures import ThreadPoolExecutor

    te, se = engines
    batches = [[work(te.schema, history(25, seed=300 + 4 * b + i), KINDS[i % 3], uid=f"fl{b}-{i}", seed=i)
                for i in range(4)] for b in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(se.run, batches))
    for batch, got in zip(batches, results):
        for a, b in zip(te.run(batch), got):
            np.testing.assert_array_equal(a.item_ids, b.item_ids)
            np.testing.assert_allclose(a.scores, b.scores, rtol=TOL, atol=TOL)


def test_pin_to_moves_every_thread_of_the_runtimes_processes_and_calls_still_answer(engines):
    """``SGLangEngine.pin_to`` (the server's serve.engine_cpus plan) puts the scheduler and the
    detokenizer, every thread, on the CPUs given; the engine answers as before."""
    import os

    te, se = engines
    everywhere = tuple(sorted(os.sched_getaffinity(0)))
    one = (everywhere[-1],)
    try:
        se.pin_to(one)
        procs = se.runtimes.active.procs
        assert procs and all(os.sched_getaffinity(t.id) == set(one) for p in procs for t in p.threads())
        same(te, se, [work(te.schema, history(30, seed=77), "rank", uid="pinned", seed=1)])
    finally:
        se.pin_to(everywhere)


def test_models_it_does_not_serve_are_refused_with_the_fix(tiny_synth, tmp_path):
    from genrec.serve.sglang_engine import SGLangEngine
    from tests.serving_helpers import tiny_ranking_artifact

    art = tiny_ranking_artifact(tiny_synth, tmp_path, tower="transformer")
    with pytest.raises(ValueError, match='engine = "torch"'):
        SGLangEngine(art)


def test_sglang_engine_behind_the_grpc_server(artifact, engines):
    te, engine = engines
    srv = ThreadedServer(artifact, engine=engine)
    try:
        c = srv.client(timeout_s=30)
        u = user([(5, T0, 3), (9, T0 + 60, 1)], {"region": [2]})
        rec = c.recommend(u, retrieve_k=20, top_k=5)
        assert len(rec.items) == 5 and c.info().engine == "sglang"
        ref = te.run([decode("recommend", pb.RecommendRequest(user=u, retrieve_k=20, top_k=5).SerializeToString(),
                             engine.schema, Limits())])[0]
        assert [i.item_id for i in rec.items] == ref.item_ids.tolist()
    finally:
        srv.stop()  # (the engine is the module's: closed by its fixture)
