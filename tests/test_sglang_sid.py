"""Generative retrieval decoded by SGLang (issue 33): the semantic-ID decoder's beams in
SGLang's built-in beam search, against the PyTorch reference ``SIDDecoder.beam_search``.

The first tests drive ``SIDSteps`` (the model's side of a step) with SGLang's own selection
functions, without an engine: they pin down why the vocabulary carries padding ids and why
the last level is selected by the model. The rest run the SGLang engine on a tiny artifact
with a decoder (random-ish weights: one epoch): same items, same log-probabilities, every item
real and outside the exclusions, histories from the radix cache.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from genrec.loadtest.client import user
from genrec.models.sid import build_semantic_ids
from genrec.models.sid_decoder import SIDConfig, SIDDecoder
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.engine import TorchEngine
from genrec.serve.requests import Limits, decode
from tests.serving_helpers import tiny_sid_artifact

TOL = 1e-5
T0 = 1_700_000_000
GEN, BOTH = pb.RETRIEVAL_SOURCE_GENERATIVE, pb.RETRIEVAL_SOURCE_BOTH


# ----- SIDSteps under SGLang's selection, no engine ----------------------------------------
def decoder(sizes: tuple[int, ...] = (4, 4), items: int = 120, seed: int = 0) -> SIDDecoder:
    torch.manual_seed(seed)
    ids = torch.arange(1, items + 1)
    sid = build_semantic_ids(ids, torch.randn(items, 16), sizes=sizes, iters=5, seed=seed)
    cfg = SIDConfig(enabled=True, codebook="unused", num_layers=2, num_heads=2, dim=16, dropout=0.0)
    return SIDDecoder(cfg, 16, sid).eval()


def sglang_beam(steps, h: torch.Tensor, beam: int, seen: np.ndarray | None = None, model_ends: bool = True):
    """One beam as SGLang's coordinator runs it over ``steps``' logits: per row the top 2 x beam
    log-probabilities (logsumexp-normalised raw logits, as its ``_rows_topk_logprobs``), then
    its ``joint_select`` at every level but the last; the last level ends in ``steps.final``
    (the model's selection) or, ``model_ends=False``, in SGLang's ``select_final_topk`` ->
    (items, scores, the survivors' cumulative log-probabilities at each level)."""
    import importlib

    importlib.import_module("genrec.serve.sglang_runtime").prepare_environment("cpu")  # first: SGLang's import on CPU
    select = importlib.import_module("sglang.srt.beam_search.joint_select")
    joint_select, select_final_topk = select.joint_select, select.select_final_topk

    from genrec.serve.sglang_models.sid_steps import SIDBeams

    beams = SIDBeams(steps, h.numel())  # the model's side of a step, as the engine's model runs it
    beams.keep(7, h, beam, seen)
    tokens, levels = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    cum, history = torch.zeros(1), []
    for level in range(steps.levels):
        if model_ends:
            logits, results = beams.step(torch.full_like(tokens, 7), tokens, levels)
        else:
            logits, _ = steps.logits(h.expand(tokens.numel(), -1), tokens, levels,
                                     torch.ones(tokens.numel(), dtype=torch.bool))
        lp = logits - torch.logsumexp(logits, -1, keepdim=True)
        top, tok = lp.topk(min(2 * beam, lp.shape[1]), dim=-1)
        if level == steps.levels - 1:
            if model_ends:
                if not results:  # (only without padding: no row holds a node of this level)
                    return np.zeros(0, np.int64), np.zeros(0, np.float32), history
                res = results[min(results)]
                return np.asarray(res["items"], np.int64), np.asarray(res["scores"], np.float32), history
            sel = select_final_topk(cum, top, tok, beam)
            node = sel.tokens - steps.base[steps.levels]
            ok = torch.isfinite(sel.cum_logprobs)
            return steps.head.sid.leaf_item[node[ok]].numpy(), sel.cum_logprobs[ok].numpy(), history
        sel = joint_select(cum, top, tok, torch.zeros(0, dtype=torch.long), beam)
        tokens, cum = sel.next_tokens[:beam], sel.new_cum_logprobs[:beam]
        levels = torch.full_like(tokens, level + 1)
        history.append(cum)
    raise AssertionError("unreachable")


def reference(dec: SIDDecoder, h: torch.Tensor, beam: int, seen: np.ndarray | None = None):
    s = None if seen is None else (torch.from_numpy(seen), torch.tensor([seen.size]))
    items, scores = dec.beam_search(h[None], beam, s)
    keep = items[0] >= 0
    return items[0][keep].numpy(), scores[0][keep].numpy()


@pytest.mark.parametrize("beam", [1, 3, 10, 40])
def test_sglang_selection_over_the_trie_logits_is_the_reference_beam(beam):
    """Beams wider than a level's live (prefix, code) pairs included (4 codes at level 0): the
    padding ids fill them, and the items and scores equal the reference's, exclusions too."""
    from genrec.serve.sglang_models.sid_steps import SIDSteps

    dec = decoder()
    steps = SIDSteps(dec, max_beam=64)
    for seed in range(3):
        h = torch.randn(16, generator=torch.Generator().manual_seed(seed))
        ref_items, ref_scores = reference(dec, h, beam)
        seen = ref_items[::3].copy()
        for exclude in (None, seen):
            want = reference(dec, h, beam, exclude)
            items, scores, _ = sglang_beam(steps, h, beam, exclude)
            np.testing.assert_array_equal(items, want[0])
            np.testing.assert_allclose(scores, want[1], rtol=TOL, atol=TOL)
            assert np.isin(items, dec.sid.item_ids.numpy()).all()
            if exclude is not None:
                assert not np.isin(items, exclude).any()
        # without exclusions SGLang's own last selection is the same beam
        items, scores, _ = sglang_beam(steps, h, beam, model_ends=False)
        np.testing.assert_array_equal(items, ref_items)
        np.testing.assert_allclose(scores, ref_scores, rtol=TOL, atol=TOL)


def exhausting(dec: SIDDecoder, items: np.ndarray, prefixes: int) -> np.ndarray:
    """Every item under the first L-1 codes of the first ``prefixes`` of ``items`` (those
    prefixes left with nothing to return), and every third of ``items`` besides (some siblings)."""
    sid = dec.sid
    codes = sid.codes_of(torch.from_numpy(items))[:prefixes, :-1]
    under = (sid.codes[:, None, :-1] == codes[None]).all(-1).any(1)
    return np.union1d(sid.item_ids[under].numpy(), items[::3]).astype(np.int64)


@pytest.mark.parametrize("sizes,items", [((4, 4), 200), ((8, 8), 100), ((4, 4, 4), 150)])
def test_a_prefix_whose_items_are_all_excluded_takes_no_beam_row(sizes, items):
    """``beam_search`` drops, at every level, a prefix all of whose items the user has, so its
    beam's rows go to prefixes that can end on an item. SGLang's selection kept it (it sees no
    exclusions before the last level): the beam ended one item short, or on other items (Beauty:
    12,101 items on 256/256/256/9 codes, most last-level prefixes one item: ~25% of requests).
    Codebooks with many siblings per prefix (200 items on 4 x 4 prefixes) and with few (100 on
    64), the best prefixes' items all excluded and some of their siblings."""
    from genrec.serve.sglang_models.sid_steps import SIDSteps

    dec = decoder(sizes, items, seed=1)
    steps = SIDSteps(dec, max_beam=64)
    for seed in range(4):
        h = torch.randn(16, generator=torch.Generator().manual_seed(seed))
        for beam in (3, 10, 25):
            free, _ = reference(dec, h, beam)
            for prefixes in (1, 2):
                seen = exhausting(dec, free, prefixes)
                want = reference(dec, h, beam, seen)
                got = sglang_beam(steps, h, beam, seen)
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_allclose(got[1], want[1], rtol=TOL, atol=TOL)
                assert not np.isin(got[0], seen).any()


def test_without_padding_a_wide_beam_selects_minus_infinity_candidates():
    """Why the padding ids: with none, a beam of 10 over the root's 4 codes makes SGLang keep 6
    candidates whose logit was -inf (their token ids are whatever its top-k returned); with
    them, the beam's spare rows hold padding ids, finite and recognisable."""
    from genrec.serve.sglang_models.sid_steps import SIDSteps

    dec = decoder()
    assert int((dec.sid.children[0] >= 0).sum()) == 4
    h = torch.randn(16)
    _, _, cums = sglang_beam(SIDSteps(dec, max_beam=0), h, 10)
    assert int((~torch.isfinite(cums[0])).sum()) == 6
    _, _, cums = sglang_beam(SIDSteps(dec, max_beam=16), h, 10)
    assert torch.isfinite(cums[0]).all()


def test_masking_exclusions_in_the_logits_would_renormalise_the_last_level():
    """Why the model ends the beam: SGLang normalises over the logits it gets, so an excluded
    item masked there moves its mass onto its siblings and the scores leave the reference's."""
    from genrec.serve.sglang_models.sid_steps import SIDSteps

    dec = decoder(sizes=(4,))  # 4 codes, then the collision level: many siblings per prefix
    steps = SIDSteps(dec, max_beam=16)
    h = torch.randn(16)
    items, _ = reference(dec, h, 10)
    seen = items[::2].copy()
    want = dict(zip(*(a.tolist() for a in reference(dec, h, 10, seen))))
    excluded = steps.base[steps.levels] + torch.isin(dec.sid.leaf_item, torch.from_numpy(seen)).nonzero().squeeze(1)
    plain = steps.logits

    def masked(prompts, tokens, levels, live):  # noqa: ANN001, ANN202 - the exclusions inside the logits
        out, last = plain(prompts, tokens, levels, live)
        out[:, excluded] = -torch.inf
        return out, last

    steps.logits = masked
    got, scores, _ = sglang_beam(steps, h, 10, model_ends=False)
    assert not np.isin(got, seen).any()
    shift = [s - want[i] for i, s in zip(got.tolist(), scores.tolist()) if i in want]
    assert shift and max(shift) > 1e-3  # inflated by the renormalisation


# ----- the SGLang engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def art(tiny_synth, tmp_path_factory):
    return tiny_sid_artifact(tiny_synth, tmp_path_factory.mktemp("sglsid"))


@pytest.fixture(scope="module")
def engines(art):
    from genrec.serve.sglang_engine import SGLangEngine

    sgl = SGLangEngine(art, pool_tokens=8192, threads=1, max_beam=64, beam_rows=256)
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


@pytest.mark.parametrize("beam", [1, 2, 20, 64])
def test_generate_equals_the_reference_beam(engines, beam):
    """Beams of several users in one batch, each leaving its history out; 64 is wider than the
    first level's 8 codes. Every item is a catalogue item and none is excluded."""
    te, se = engines
    works = [work(te.schema, history(4 + 7 * s, s), beam=beam, exclude=(s + 1,)) for s in range(4)]
    users = torch.randn(len(works), te.model.embedding_cfg.dim, generator=torch.Generator().manual_seed(beam))
    pairs = list(enumerate(works))
    got = se.generate(users, pairs)
    same_beams(te.generate(users, pairs), got)
    for i, w in pairs:
        assert 0 < got[i][0].size <= beam and np.isin(got[i][0], te.corpus_np).all()
        assert not np.isin(got[i][0], w.excluded()).any()
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


def test_sglang_ends_an_unexcluded_beam_as_the_model_does(engines):
    """SGLang's own beam results (its final selection over the model's last-level logits, n =
    beam sequences of trie-node tokens) name the same items with the same log-probabilities."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    te, se = engines
    beam, levels = 20, se.sid.levels
    h = torch.randn(1, te.model.embedding_cfg.dim)
    w = work(te.schema, history(5, 1), beam=beam)
    w.exclude_history = False
    want = te.generate(h, [(0, w)])[0]
    ticket = next(se._tickets)
    se.generate(h, [(0, w)])  # warm; then register a prompt and run SGLang's own beam on it
    reg = {"ticket": ticket, "beam": beam, "prompt": h[0].tolist(), "seen": None}
    from genrec.serve.sglang_models.codec import PAYLOAD, TICKET_BASE

    async def call() -> list:
        first = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "custom_params": {
            PAYLOAD: {"register": reg}}}, custom_logit_processor=se.processor, extra_key=f"t{ticket}")
        await rt.engine.tokenizer_manager.generate_request(first, None).__anext__()
        obj = GenerateReqInput(input_ids=[TICKET_BASE + ticket], sampling_params={
            "max_new_tokens": levels, "ignore_eos": True, "beam_width": beam, "n": beam}, extra_key=f"b{ticket}")
        return await rt.engine.tokenizer_manager.generate_request(obj, None).__anext__()

    rt = se.runtimes.active
    out = asyncio.run_coroutine_threadsafe(call(), rt.loop).result()
    seqs = out["meta_info"]["beam_results"]
    leaves = [s["output_ids"][levels - 1] - se.sid.base[levels] for s in seqs]
    items = te.model.sid_head.sid.leaf_item[torch.tensor(leaves)].numpy()
    scores = np.array([s["meta_info"]["sequence_score"] * levels for s in seqs])  # score = cum / length
    np.testing.assert_array_equal(items, want[0])
    np.testing.assert_allclose(scores, want[1], rtol=TOL, atol=TOL)


def deadline(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


def test_a_beam_ahead_of_its_prompt_is_sent_again_and_one_without_is_an_error(engines):
    from genrec.serve.sglang_engine import _Req

    te, se = engines
    h = torch.randn(1, te.model.embedding_cfg.dim)
    w = work(te.schema, history(5, 2), beam=8)
    want = te.generate(h, [(0, w)])[0]
    ticket = next(se._tickets)
    reg = {"ticket": ticket, "beam": 8, "prompt": h[0].tolist(), "seen": w.excluded().tolist()}
    # the beam first, its prompt after it in the same batch: SGLang may run the beam before the prompt
    outs = se.send([se._beam(ticket, 8), _Req([0], {"register": reg}, "r")], deadline())
    res = next((v for v in reversed(outs[0]["meta_info"].get("genrec_sid") or []) if isinstance(v, dict)), None)
    if res is None or "retry" in res:  # it did: sent again, the beam finds its prompt
        got = se._call([], {0: (ticket, 8)}, deadline())[1][0]
    else:
        got = se._items(res)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=TOL, atol=TOL)
    with pytest.raises(RuntimeError, match="without a result"):
        se._call([], {0: (next(se._tickets), 8)}, deadline())  # a ticket nobody registered
    same_beams(te.generate(h, [(0, w)]), se.generate(h, [(0, w)]))  # and the engine goes on


def test_beams_from_several_threads_share_the_scheduler(engines):
    te, se = engines
    batches = [[(i, work(te.schema, history(5 + i, 70 + 3 * b + i), beam=10 + 5 * b)) for i in range(3)]
               for b in range(4)]
    vecs = [torch.randn(3, te.model.embedding_cfg.dim, generator=torch.Generator().manual_seed(b)) for b in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(se.generate, vecs, batches))
    for v, batch, g in zip(vecs, batches, got):
        same_beams(te.generate(v, batch), g)
