"""The semantic-ID decoder (models/sid_decoder.py): its beam is exact, trie-bound and learns."""

from __future__ import annotations

import copy

import pytest
import torch

from genrec.config import ConfigError, load_config
from genrec.models.sid import SemanticIds, build_semantic_ids
from genrec.models.sid_decoder import SIDConfig, SIDDecoder
from genrec.train.eval.evaluate import generated_ranks

ITEMS = torch.arange(1, 201)


def decoder(seed: int = 0, sizes: tuple[int, ...] = (6, 6), dim: int = 16) -> SIDDecoder:
    torch.manual_seed(seed)
    sid = build_semantic_ids(ITEMS, torch.randn(ITEMS.numel(), dim), sizes=sizes, iters=5, seed=seed)
    cfg = SIDConfig(enabled=True, codebook="unused", num_layers=1, num_heads=2, dim=dim, dropout=0.0)
    return SIDDecoder(cfg, dim, sid).eval()


def log_prob(dec: SIDDecoder, h: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """log P(item | h) of each item, from the training loss (the mean over levels)."""
    return torch.stack([-dec.loss(h[None], i.view(1)) * dec.levels for i in items]).detach()


def test_beam_scores_are_the_items_log_probabilities_and_the_beam_finds_the_best():
    dec = decoder()
    h = torch.randn(3, 16)
    items, scores = dec.beam_search(h, 10)
    for u in range(3):
        assert torch.allclose(log_prob(dec, h[u], items[u]), scores[u], atol=1e-5)
        every = log_prob(dec, h[u], ITEMS)
        assert abs(float(every.exp().sum()) - 1.0) < 1e-4  # a distribution over the catalogue
        # a beam of 10 finds the most probable item (the levels here are few and small)
        assert int(items[u, 0]) == int(ITEMS[every.argmax()])


def test_the_beam_ends_only_on_real_items_leaves_out_seen_ones_and_pads():
    dec = decoder(sizes=(4, 4))
    h = torch.randn(4, 16)
    items, _ = dec.beam_search(h, 30)
    assert bool(torch.isin(items, ITEMS).all())
    assert all(len(set(row.tolist())) == 30 for row in items)  # no item twice
    seen_ids, lengths = items[:, :5].reshape(-1), torch.full((4,), 5)
    again, _ = dec.beam_search(h, 30, (seen_ids, lengths))
    for u in range(4):
        assert not set(again[u].tolist()) & set(items[u, :5].tolist())
        assert again[u, :5].tolist() == items[u, 5:10].tolist()  # the rest keep their order
    everything, scores = dec.beam_search(h[:1], 260)  # a beam wider than the catalogue
    assert sorted(everything[0, :200].tolist()) == ITEMS.tolist()
    assert (everything[0, 200:] == -1).all() and torch.isinf(scores[0, 200:]).all()


def test_a_loaded_state_brings_its_own_codebook():
    a = decoder(seed=0)
    b = copy.deepcopy(a)
    # another codebook of the same shape: a's codes dealt to other items
    perm = torch.randperm(ITEMS.numel(), generator=torch.Generator().manual_seed(0))
    a._install(SemanticIds.from_codes(ITEMS, a.sid.codes[perm], a.sid.sizes))
    assert not torch.equal(a.sid.codes, b.sid.codes)
    h = torch.randn(2, 16)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.sid.codes, a.sid.codes)
    assert torch.equal(b.beam_search(h, 8)[0], a.beam_search(h, 8)[0])


def test_the_decoder_learns_a_mapping_from_prompt_to_item():
    dec = decoder(sizes=(8, 8)).train()
    prompts = torch.randn(40, 16)
    targets = ITEMS[torch.randperm(ITEMS.numel(), generator=torch.Generator().manual_seed(0))[:40]]
    opt = torch.optim.Adam(dec.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        loss = dec.loss(prompts, targets)
        first = float(loss) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    dec.eval()
    top = dec.beam_search(prompts, 5)[0][:, 0]
    assert float(loss) < 0.1 * first
    assert float((top == targets).float().mean()) > 0.9


def test_generated_ranks():
    items = torch.tensor([[5, 7, 9], [1, 2, -1], [3, 4, 6]])
    ranks = generated_ranks(items, torch.tensor([9, 2, 8]), corpus_size=100)
    assert ranks.tolist() == [2, 1, 100]


def test_model_without_a_codebook_is_refused_and_config_extends(tmp_path):
    with pytest.raises(ValueError, match="codebook"):
        SIDConfig(enabled=True)
    base = tmp_path / "base.toml"
    base.write_text('[model]\nmax_seq_len = 50\n[model.sid]\nbeam_width = 7\n')
    top = tmp_path / "top.toml"
    top.write_text('extends = "base.toml"\n[model.sid]\nbeam_width = 9\n')
    from genrec.train.job import JobConfig

    job = load_config(JobConfig, top)
    assert (job.model.max_seq_len, job.model.sid.beam_width) == (50, 9)
    base.write_text('extends = "top.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config(JobConfig, top)


def test_a_generative_run_starts_from_a_dense_run_and_evaluates_both_channels(tiny_synth, tmp_path, capsys):
    """configs/sid.toml end to end on a tiny dataset: a dense run -> its codebook -> a run with
    the decoder started from the dense run (train.init_from) -> dense and decoded metrics from
    training and from ``genrec eval --run``, the same."""
    from genrec.train.cli import evaluate_run
    from genrec.train.job import build_model, load_job
    from genrec.train.loop import checkpoint as ckpt
    from genrec.train.loop.launch import run_training
    from genrec.train.sid_build import load_item_vectors
    from tests.conftest import TINY_TABLES, tiny_job_overrides

    cfg = tmp_path / "dense.toml"
    cfg.write_text(TINY_TABLES)
    over = tiny_job_overrides(tiny_synth, tmp_path / "runs") + ["--train.max_epochs=1"]
    dense_run, _ = run_training(load_job(cfg, over + ["--run.name=dense"]))
    ids, vectors = load_item_vectors(*ckpt.resolve_checkpoint(dense_run))
    book = tmp_path / "book.safetensors"
    build_semantic_ids(ids, vectors, sizes=(8, 8), iters=5).save(book)
    sid_over = over + ["--run.name=gen", f'--model.sid.codebook="{book}"', "--model.sid.beam_width=20",
                       "--model.sid.num_layers=1", "--train.early_stop_metric=gen_ndcg@10"]
    cfg.write_text(TINY_TABLES + '\n[model.sid]\nenabled = true\n')
    job = load_job(cfg, sid_over + [f'--train.init_from="{dense_run}"'])

    # the warm start: every tensor but the decoder's comes from the dense run's best checkpoint
    dense_model, _ = build_model(load_job(dense_run / "config.toml"))
    ckpt.load_checkpoint(ckpt.resolve_checkpoint(dense_run)[1], dense_model, None)
    model, _ = build_model(job)
    left = ckpt.warm_start(model, ckpt.resolve_checkpoint(dense_run)[1])
    assert left and all(k.startswith("sid_head.") for k in left)
    assert all(torch.equal(p, dict(dense_model.named_parameters())[n])
               for n, p in model.named_parameters() if not n.startswith("sid_head."))

    run_dir, res = run_training(job)
    assert f"init_from {ckpt.resolve_checkpoint(dense_run)[1]}" in capsys.readouterr().out
    for k in ("ndcg@10", "gen_ndcg@10", "gen_hr@10", "gen_mrr"):
        assert k in res["test"], k
    assert res["test"]["gen_hr@50"] >= res["test"]["gen_hr@10"] > 0.0  # the decoder ranks the target sometimes
    book.unlink()  # the run keeps its own copy of the codebook
    again, _ = evaluate_run(run_dir, None, "test")
    for k in ("ndcg@10", "gen_ndcg@10", "gen_mrr"):
        assert again[k] == pytest.approx(res["test"][k], abs=1e-9), k


def test_a_ranking_model_trains_its_decoder_too():
    """With ranking tasks the total loss was rebuilt from the retrieval and ranking terms,
    leaving the decoder's out: such a model never trained its decoder."""
    from dataclasses import replace

    from genrec.models.recommender import GenerativeRecommender
    from tests.test_ranking import HACT, HIST, emb_cfg, make_batch, model

    base = model()
    corpus = torch.arange(1, 40)
    sid = build_semantic_ids(corpus, torch.randn(39, 8, generator=torch.Generator().manual_seed(0)),
                             sizes=(4, 4), iters=5)
    cfg = replace(base.cfg, sid=SIDConfig(enabled=True, codebook="unused", num_layers=1, dim=16, dropout=0.0))
    m = GenerativeRecommender(cfg, emb_cfg(), corpus, sid=sid)
    batch = make_batch([(HIST, HACT, [5, 6]), (HIST[:3], HACT[:3], [8])])
    batch.targets = torch.tensor(HIST[1:] + [2] + HIST[1:3] + [11])
    out = m(batch)
    assert {"ranking", "sid"} <= set(out)
    expected = cfg.ranking.retrieval_weight * out["retrieval"] + out["ranking"] + cfg.sid.weight * out["sid"]
    assert torch.allclose(out["loss"], expected)
    out["loss"].backward()
    assert m.sid_head.heads[0].weight.grad.abs().sum() > 0


def test_the_trie_follows_the_decoder_to_its_device():
    dec = decoder()
    moved = dec.to("meta")
    assert moved.sid.leaf_item.device.type == "meta" and moved.sid.children[0].device.type == "meta"
    assert dec.to(torch.bfloat16).book_codes.dtype == torch.long  # casts leave the codebook alone


def test_a_long_history_still_fills_the_beam():
    """Exclusion pruned only the last level: a user who had most of a subtree's items got
    beams ending on them, dropped, and fewer than K items back (ML-1M: 35 of 50 on average)."""
    dec = decoder(sizes=(8, 8))
    h = torch.randn(2, 16)
    best, _ = dec.beam_search(h, 200)
    seen_ids = torch.cat([best[0, :190], best[1, :190]])  # each user had their 190 likeliest items
    items, scores = dec.beam_search(h, 10, (seen_ids, torch.tensor([190, 190])))
    for u in range(2):
        assert sorted(items[u].tolist()) == sorted(best[u, 190:].tolist())  # every one of the 10 left
        assert torch.isfinite(scores[u]).all()
