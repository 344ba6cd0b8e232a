"""Generative retrieval on the SGLang engine (issues 33, 42): the semantic-ID decoder's beams
decoded in the SGLang model's forward, against the torch engine (``SIDDecoder.beam_search``).

A tiny artifact with a decoder (random-ish weights: one epoch): same items, same
log-probabilities, every item real and outside the exclusions, histories from the radix cache,
and one SGLang request per work (the beam, its fusion with the dense top-k and the ranking of
what it found all in that request's forward).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from genrec.loadtest.client import user
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.engine import TorchEngine
from genrec.serve.requests import Limits, decode
from tests.serving_helpers import tiny_sid_artifact

TOL = 1e-5
T0 = 1_700_000_000
GEN, BOTH = pb.RETRIEVAL_SOURCE_GENERATIVE, pb.RETRIEVAL_SOURCE_BOTH


# ----- the SGLang engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def art(tiny_synth, tmp_path_factory):
    return tiny_sid_artifact(tiny_synth, tmp_path_factory.mktemp("sglsid"))


@pytest.fixture(scope="module")
def engines(art):
    from genrec.serve.sglang_engine import SGLangEngine

    sgl = SGLangEngine(art, pool_tokens=8192, threads=1, max_beam=64)
    try:
        yield TorchEngine(art), sgl
    finally:
        sgl.close()


def history(n: int, seed: int, start: int = 0) -> list[tuple[int, int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(1, 600)), T0 + 90 * (start + j), int(rng.choice([1, 3, 7]))) for j in range(n)]


def work(schema, hist, kind: str = "retrieve", source: int = GEN, beam: int = 0, uid: str = "", k: int = 20,
         exclude: tuple[int, ...] = ()):
    u = user(hist, {"region": [1]})
    u.user_id = uid
    if kind == "retrieve":
        req = pb.RetrieveRequest(user=u, k=k, source=source, beam=beam, exclude_items=list(exclude))
    else:
        req = pb.RecommendRequest(user=u, retrieve_k=k, top_k=5, source=source, beam=beam, exclude_items=list(exclude))
    return decode(kind, req.SerializeToString(), schema, Limits(max_beam=64))


def same_beams(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        np.testing.assert_array_equal(a[i][0], b[i][0])
        np.testing.assert_allclose(a[i][1], b[i][1], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("exclusions", [True, False])
@pytest.mark.parametrize("beam", [1, 2, 20, 64])
def test_generate_equals_the_reference_beam(engines, beam, exclusions):
    """Beams of several users in one batch, each leaving its history out (or nothing); 64 is
    wider than the first level's 8 codes. Every item is a catalogue item and none is excluded."""
    te, se = engines
    works = [work(te.schema, history(4 + 7 * s, s), beam=beam, exclude=(s + 1,) if exclusions else ())
             for s in range(4)]
    for w in works:
        w.exclude_history = exclusions
    users = torch.randn(len(works), te.model.embedding_cfg.dim, generator=torch.Generator().manual_seed(beam))
    pairs = list(enumerate(works))
    got = se.generate(users, pairs)
    same_beams(te.generate(users, pairs), got)
    for i, w in pairs:
        assert 0 < got[i][0].size <= beam and np.isin(got[i][0], te.corpus_np).all()
        assert w.excluded() is None or not np.isin(got[i][0], w.excluded()).any()
        assert np.all(np.diff(got[i][1]) <= 0)  # best first


def test_generative_and_merged_retrieval_through_run_match_the_torch_engine(engines):
    """Retrieve and Recommend from the decoder alone and from both sources (the merged list
    ranked in a second call); the users' histories come from SGLang's radix cache when they call again."""
    te, se = engines
    for source in (GEN, BOTH):
        for kind in ("retrieve", "recommend"):
            works = [work(te.schema, history(6 + 9 * s, 40 + s), kind, source, uid=f"g{source}{kind}{s}")
                     for s in range(3)]
            for call in range(2):
                for a, b in zip(te.run(works), got := se.run(works)):
                    np.testing.assert_array_equal(a.item_ids, b.item_ids)
                    np.testing.assert_allclose(a.scores, b.scores, rtol=TOL, atol=TOL)
                    np.testing.assert_allclose(a.generative_scores, b.generative_scores, rtol=TOL, atol=TOL)
                if call:  # all but the last event from the pool
                    assert [r.cached_tokens for r in got] == [r.history_tokens - 1 for r in got]


def test_beams_from_several_threads_share_the_scheduler(engines):
    te, se = engines
    batches = [[(i, work(te.schema, history(5 + i, 70 + 3 * b + i), beam=10 + 5 * b)) for i in range(3)]
               for b in range(4)]
    vecs = [torch.randn(3, te.model.embedding_cfg.dim, generator=torch.Generator().manual_seed(b)) for b in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(se.generate, vecs, batches))
    for v, batch, g in zip(vecs, batches, got):
        same_beams(te.generate(v, batch), g)


def test_a_generative_work_is_one_sglang_request(engines):
    """The beam runs in the work's own forward: Retrieve and Recommend from the decoder or from
    both sources, and a decode from a given vector, each cost one SGLang request per work
    (counted at the runtime). Before: a tower request, a beam request (SGLang's beam search,
    levels + 1 scheduler rounds) and, for a Recommend, a second tower request ranking the beam's items."""
    te, se = engines
    rt = se.runtimes.active
    works = [work(te.schema, history(7 + 3 * s, 90 + s), kind, source, uid=f"one{s}{kind}{source}")
             for s, (kind, source) in enumerate([("retrieve", GEN), ("retrieve", BOTH), ("recommend", GEN),
                                                 ("recommend", BOTH)])]
    before = rt.requests
    got = se.run(works)
    assert rt.requests - before == len(works)
    for a, b in zip(te.run(works), got):
        np.testing.assert_array_equal(a.item_ids, b.item_ids)
        np.testing.assert_allclose(a.scores, b.scores, rtol=TOL, atol=TOL)
    users = torch.randn(2, te.model.embedding_cfg.dim)
    before = rt.requests
    same_beams(te.generate(users, list(enumerate(works[:2]))), se.generate(users, list(enumerate(works[:2]))))
    assert rt.requests - before == 2
