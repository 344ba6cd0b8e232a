"""Generative retrieval served: the semantic-ID decoder in the artifact, the RetrievalSource of
Retrieve / Recommend (dense, generative, both), the merge, the status codes of bad requests,
and artifacts without a decoder. Tiny models; server calls go through grpcio."""

from __future__ import annotations

import json
import random
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from genrec.benchmarks.naive_engine import NaiveTorchEngine
from genrec.loadtest.client import RecommenderClient, user
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.quant.convert import QuantizeConfig, export, load_training_model, resolve_checkpoint
from genrec.quant.load import load_model
from genrec.serve.engine import TorchEngine
from genrec.serve.layout import collate_users, schema_of
from genrec.serve.requests import Limits, Work, decode_user
from genrec.serve.retrieval import RRF_K
from tests.serving_helpers import ThreadedServer, local_config, tiny_sid_artifact

pytestmark = pytest.mark.serving

T0 = 1_700_000_000
CTX = {"region": [3]}
DENSE, GEN, BOTH = pb.RETRIEVAL_SOURCE_DENSE, pb.RETRIEVAL_SOURCE_GENERATIVE, pb.RETRIEVAL_SOURCE_BOTH
BEAM = 20  # the artifact's model.sid.beam_width


def history(n: int = 8, seed: int = 0) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 600), T0 + 60 * i, rng.choice([1, 3, 7])) for i in range(n)]


def users(n: int = 6) -> list[pb.User]:
    return [user(history(5 + 2 * s, s), CTX) for s in range(n)]


@pytest.fixture(scope="module")
def sid(tiny_synth, tmp_path_factory):
    """The decoder's artifact (fp32 tables and dense), its run, and an artifact of the dense
    run the codebook came from, its manifest stripped of "generative" (as older genrec wrote it)."""
    out = tmp_path_factory.mktemp("sid")
    art = tiny_sid_artifact(tiny_synth, out)
    run = Path(json.loads((art / "manifest.json").read_text())["source"]["run_dir"])
    dense_run = next((out / "dense" / "runs").rglob("config.toml")).parent
    old = out / "artifact-old"
    export(dense_run, old, QuantizeConfig(), progress=False, measure_accuracy=False)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["generative"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    return {"artifact": art, "run": run, "old": old, "out": out}


@pytest.fixture(scope="module")
def server(sid):
    srv = ThreadedServer(sid["artifact"], local_config(limits=Limits(max_beam=64)))
    yield srv
    srv.stop()


def expected_beam(engine: TorchEngine, u: pb.User, beam: int, exclude: list[int] = ()) -> tuple[list, np.ndarray]:
    """The PyTorch reference: the decoder's beam_search on the model's user vector of ``u``, the
    history (and ``exclude``) left out, -1 padding dropped."""
    ui = decode_user(u, engine.schema, Limits())
    batch = collate_users([ui], engine.model, engine.device)
    with torch.inference_mode():
        vec = engine.model.user_embeddings(batch)
        seen = np.concatenate([ui.items, np.asarray(exclude, np.int64)])
        items, logp = engine.model.sid_head.beam_search(vec, beam, (torch.from_numpy(seen), torch.tensor([seen.size])))
    keep = items[0] >= 0
    return items[0][keep].tolist(), logp[0][keep].numpy()


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    return e.value


def test_the_artifact_carries_the_decoder_and_codebook_untouched(sid):
    art, out = sid["artifact"], sid["out"]
    manifest = json.loads((art / "manifest.json").read_text())
    _, trained = load_training_model(*resolve_checkpoint(sid["run"]))
    sizes = manifest["generative"]["sizes"]
    assert manifest["generative"] == {"levels": 3, "sizes": sizes, "items": trained.corpus_ids.numel(), "beam_width": BEAM}
    assert sizes == [8, 8, int(trained.sid_head.book_sizes[2])]
    fp32 = load_file(str(art / "dense.safetensors"))
    for k in ("item_ids", "codes", "sizes"):
        assert fp32[f"sid_head.book_{k}"].dtype == torch.int64
        assert torch.equal(fp32[f"sid_head.book_{k}"], getattr(trained.sid_head, f"book_{k}"))
    # int8 dense: the tower's Linears are quantized, every sid_head tensor is stored as trained
    q = out / "artifact-sid-int8"
    export(sid["run"], q, QuantizeConfig(dense="int8"), progress=False, measure_accuracy=False)
    int8 = load_file(str(q / "dense.safetensors"))
    assert any(k.endswith(".weight.codes") for k in int8)
    decoder = {k for k in fp32 if k.startswith("sid_head.")}
    assert decoder and decoder <= set(int8)
    assert all(torch.equal(int8[k], fp32[k]) for k in decoder)
    served, _ = load_model(q)
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
               for m in served.sid_head.modules() if "Linear" in type(m).__name__)


def test_the_artifacts_decoder_beams_equal_the_checkpoints(sid):
    _, trained = load_training_model(*resolve_checkpoint(sid["run"]))
    served, _ = load_model(sid["artifact"])
    ui = [decode_user(u, schema_of(served), Limits()) for u in users()]
    with torch.inference_mode():
        want = trained.generate(collate_users(ui, trained, torch.device("cpu")), BEAM)
        got = served.generate(collate_users(ui, served, torch.device("cpu")), BEAM)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert (want[0] >= 0).sum() > 0


def test_retrieve_generative_is_the_decoders_beam_over_the_catalogue(server):
    c = RecommenderClient(server.target)
    engine = server.server.engine
    catalogue = set(engine.corpus_np.tolist())
    for u in users():
        got = c.retrieve(u, k=BEAM, source=GEN).items
        ids, logp = expected_beam(engine, u, BEAM)
        assert [i.item_id for i in got] == ids and set(ids) <= catalogue
        assert not set(ids) & {e.item_id for e in u.history}
        np.testing.assert_allclose([i.generative_log_prob for i in got], logp, atol=1e-4)
        np.testing.assert_allclose([i.score for i in got], logp, atol=1e-4)
        assert all(i.HasField("generative_log_prob") and not i.HasField("retrieval_score") for i in got)
    # k cuts the beam; exclude_items leaves items out of it; another beam is another search
    u = users()[0]
    first = [i.item_id for i in c.retrieve(u, k=BEAM, source=GEN).items]
    assert [i.item_id for i in c.retrieve(u, k=5, source=GEN).items] == first[:5]
    cut = [i.item_id for i in c.retrieve(u, k=BEAM, source=GEN, exclude_items=first[:3]).items]
    assert cut == expected_beam(engine, u, BEAM, first[:3])[0] and not set(cut) & set(first[:3])
    wide = [i.item_id for i in c.retrieve(u, k=40, source=GEN, beam=40).items]
    assert wide == expected_beam(engine, u, 40)[0] and len(wide) == 40


def rrf(dense: list[int], gen: list[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for ranked in (dense, gen):
        for r, i in enumerate(ranked, 1):
            out[i] = out.get(i, 0.0) + 1.0 / (RRF_K + r)
    return out


def test_retrieve_both_is_the_deduplicated_union_with_each_sources_score(server):
    c = RecommenderClient(server.target)
    mixed = 0
    for u in users():
        dense = {i.item_id: i.retrieval_score for i in c.retrieve(u, k=10, source=DENSE).items}
        gen = {i.item_id: i.generative_log_prob for i in c.retrieve(u, k=10, source=GEN).items}
        both = c.retrieve(u, k=10, source=BOTH).items
        ids = [i.item_id for i in both]
        assert len(ids) == len(set(ids)) and set(ids) == set(dense) | set(gen)
        for i in both:
            assert i.HasField("retrieval_score") == (i.item_id in dense)
            assert i.HasField("generative_log_prob") == (i.item_id in gen)
            if i.item_id in dense:
                assert i.retrieval_score == pytest.approx(dense[i.item_id], abs=1e-4)
            if i.item_id in gen:
                assert i.generative_log_prob == pytest.approx(gen[i.item_id], abs=1e-4)
        fused = rrf(list(dense), list(gen))
        np.testing.assert_allclose([i.score for i in both], [fused[i] for i in ids], rtol=1e-9)
        assert [i.score for i in both] == sorted((i.score for i in both), reverse=True)
        mixed += bool(set(gen) - set(dense)) and bool(set(dense) - set(gen))
    assert mixed  # (the lists differ for some user: the union is not one list)


def test_recommend_both_ranks_the_union_by_the_ranking_head(server):
    c = RecommenderClient(server.target)
    generative_only_on_top = 0
    for u in users():
        union = c.retrieve(u, k=10, source=BOTH).items
        dense = {i.item_id for i in union if i.HasField("retrieval_score")}
        ranked = c.rank(u, [(i.item_id, 1.0) for i in union]).items  # the ranking head on every candidate
        want = sorted(ranked, key=lambda i: -i.score)[:10]
        got = c.recommend(u, retrieve_k=10, top_k=10, source=BOTH).items
        assert [i.item_id for i in got] == [i.item_id for i in want]
        np.testing.assert_allclose([i.score for i in got], [i.score for i in want], rtol=1e-4)
        by_id = {i.item_id: i for i in union}
        for i in got:
            assert set(i.tasks) == {"click", "conversion"}
            assert i.HasField("retrieval_score") == by_id[i.item_id].HasField("retrieval_score")
            assert i.HasField("generative_log_prob") == by_id[i.item_id].HasField("generative_log_prob")
        generative_only_on_top += any(i.item_id not in dense for i in got)
    assert generative_only_on_top  # ranking the dense list alone would have failed here


def test_the_engines_agree_and_a_batch_mixes_sources_and_beams(sid):
    torch_eng, naive = TorchEngine(sid["artifact"]), NaiveTorchEngine(sid["artifact"])
    us = [decode_user(u, torch_eng.schema, Limits()) for u in users(3)]
    works = [Work("retrieve", us[0], retrieve_k=10, source="both", beam=BEAM),
             Work("retrieve", us[1], retrieve_k=10, source="generative", beam=7),
             Work("recommend", us[2], retrieve_k=10, top_k=5, source="generative", beam=BEAM),
             Work("retrieve", us[0], retrieve_k=10)]
    batch = torch_eng.run(works)
    for w, b in zip(works, batch):
        one = torch_eng.run([w])[0]
        for r in (one, naive.run([w])[0]):
            np.testing.assert_array_equal(r.item_ids, b.item_ids)
            np.testing.assert_allclose(r.scores, b.scores, atol=1e-4)
            if b.generative_scores is not None:
                np.testing.assert_allclose(r.generative_scores, b.generative_scores, atol=1e-4)
    assert batch[1].item_ids.size == 7 and batch[3].generative_scores is None
    assert np.isnan(batch[0].retrieval_scores).any() and np.isnan(batch[0].generative_scores).any()


def test_model_info_reports_the_generative_channel(server):
    info = server.client().info()
    assert info.generative and list(info.semantic_id_sizes[:2]) == [8, 8] and len(info.semantic_id_sizes) == 3
    assert info.default_beam == BEAM and info.max_beam == 64


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def test_bad_sources_and_beams_are_invalid_argument_naming_the_field(server):
    c = RecommenderClient(server.target)
    u = users(1)[0]
    for call in (lambda **kw: c.retrieve(u, k=5, **kw), lambda **kw: c.recommend(u, retrieve_k=5, **kw)):
        for kw, field in (({"source": 7}, "source"), ({"beam": 65}, "beam"), ({"source": GEN, "beam": 1000}, "beam")):
            e = rpc_error(call, **kw)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(field + ":"), (kw, e.details())
    # beam = -1 as a client with a signed field sends it (a 10-byte varint): read as 2^32 - 1
    ch = grpc.insecure_channel(server.target)
    for method, req, tag in (("Retrieve", pb.RetrieveRequest(user=u, k=5), 0x30),
                             ("Recommend", pb.RecommendRequest(user=u, retrieve_k=5), 0x48)):
        data = req.SerializeToString() + bytes([tag]) + _varint(2**64 - 1)
        e = rpc_error(ch.unary_unary(f"/genrec.v1.Recommender/{method}"), data, timeout=5)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("beam:"), e.details()
    assert len(c.retrieve(u, k=5, source=BOTH, beam=64).items) >= 5  # the limit itself is fine


def test_an_artifact_without_a_decoder_serves_dense_and_refuses_generative(sid):
    srv = ThreadedServer(sid["old"])
    try:
        c = RecommenderClient(srv.target)
        u = users(1)[0]
        dense = c.retrieve(u, k=10).items
        assert len(dense) == 10 and all(i.HasField("retrieval_score") and not i.HasField("generative_log_prob")
                                        for i in dense)
        assert [i.item_id for i in c.retrieve(u, k=10, source=DENSE).items] == [i.item_id for i in dense]
        assert len(c.recommend(u, retrieve_k=10, top_k=5).items) == 5
        for call in (lambda s: c.retrieve(u, k=10, source=s), lambda s: c.recommend(u, retrieve_k=10, source=s)):
            for s in (GEN, BOTH):
                e = rpc_error(call, s)
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and e.details().startswith("source:"), e.details()
        # given candidates are not retrieved: the source does not matter
        assert len(c.recommend(u, top_k=2, candidates=[(5, 1.0), (9, 1.0)], source=GEN).items) == 2
        info = srv.client().info()
        assert not info.generative and info.default_beam == 0 and not info.semantic_id_sizes
    finally:
        srv.stop()


def test_a_beam_limit_the_sglang_engine_cannot_decode_is_refused_at_start(tmp_path):
    """The SGLang engine sizes its vocabulary for beams of at most 256; a server configured to
    accept wider ones would answer them with an internal error: it refuses to start instead."""
    from dataclasses import replace

    from genrec.serve.server import open_engine

    cfg = local_config(engine="sglang")
    cfg = replace(cfg, limits=replace(cfg.limits, max_beam=300))
    with pytest.raises(ValueError, match="serve.limits.max_beam"):
        open_engine(cfg, str(tmp_path / "no-artifact"))
