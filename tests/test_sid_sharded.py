"""The semantic-ID decoder on TorchRec row-wise sharded tables, 2 ranks (gloo), as the 10^7
recipe runs it (configs/scale_10m_sid.toml): a dense run with sampled softmax -> its codebook ->
a decoder run started from it with ``train.init_from`` under torchrun -> merged recall of the
dense and decoded lists, the catalogue scored in blocks."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from genrec.benchmarks.sid_quality import chunked_topk, merged_recall, user_sample
from genrec.models.sid import build_semantic_ids
from tests.test_distributed import CONFIG, TORCHRUN, free_port, run, train_args

SAMPLED = CONFIG + """
[model.retrieval]
loss = "sampled_softmax"
negatives = "mixed"
logq_correction = true
"""


def _table(run_dir) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from genrec.train.cli import load_run_model

    _, model, _, _ = load_run_model(run_dir, None, None)
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".embeddings." in n}


def test_decoder_warm_started_on_two_sharded_ranks_trains_and_merges(tiny_synth, tmp_path):
    from genrec.train.loop.checkpoint import resolve_checkpoint
    from genrec.train.sid_build import load_item_vectors

    two = TORCHRUN + ["--nproc-per-node", "2", "--master-port"]
    run(two + [str(free_port())] + train_args(tiny_synth, tmp_path, "dense", ["--train.evaluate=false",
                                                                             "--train.max_epochs=1"], SAMPLED))
    dense_run = tmp_path / "dist" / "dense"
    ids, vectors = load_item_vectors(*resolve_checkpoint(dense_run))
    book = tmp_path / "book.safetensors"
    build_semantic_ids(ids, vectors, sizes=(8, 8), iters=5).save(book)
    # the table's step size ~0: what the sid run's table holds is what init_from read into its shards
    gen = ["--train.max_epochs=1", f'--train.init_from="{dense_run}"', "--train.parallel.sparse_lr=1e-30",
           "--model.sid.num_layers=1", "--model.sid.beam_width=20", "--train.early_stop_metric=gen_ndcg@10"]
    proc = run(two + [str(free_port())] + train_args(
        tiny_synth, tmp_path, "gen", gen, SAMPLED + f'\n[model.sid]\nenabled = true\ncodebook = "{book}"\n'))
    gen_run = tmp_path / "dist" / "gen"
    assert f"init_from {resolve_checkpoint(dense_run)[1]}" in (gen_run / "train.log").read_text(), proc.stdout[-2000:]
    res = json.loads((gen_run / "results.json").read_text())
    assert res["test"]["gen_hr@50"] >= res["test"]["gen_hr@10"] > 0.0  # the decoder trained on the sharded tower
    assert json.loads((gen_run / "sharding.json").read_text())["item"].startswith("row_wise on ranks [0, 1]")
    dense_table, gen_table = _table(dense_run), _table(gen_run)
    assert dense_table.keys() == gen_table.keys() and dense_table
    for name, t in dense_table.items():
        assert torch.equal(t, gen_table[name]), name  # both ranks' shards came from the dense run

    whole = merged_recall(gen_run, dense_k=10, gen_k=5, chunk=1 << 30)
    blocks = merged_recall(gen_run, dense_k=10, gen_k=5, chunk=37)
    assert blocks == whole and whole["users"] == 300
    assert whole["merged_recall@10+5"] >= max(whole["dense_recall@10"], whole["generative_recall@5"])
    assert whole["dense_recall@15"] >= whole["dense_recall@10"] and whole["valid_share"] > 0.9
    sample = merged_recall(gen_run, dense_k=10, gen_k=5, max_users=100, chunk=37)
    assert sample["users"] == 100 and sample["user_stride"] == 3


@pytest.mark.parametrize("chunk", [1, 7, 50, 64])
def test_chunked_topk_equals_one_topk_over_the_catalogue(chunk):
    """The blocked top-k is the top-k of the whole [B, N] matrix with each history masked."""
    from genrec.train.eval.evaluate import mask_seen

    g = torch.Generator().manual_seed(0)
    corpus = torch.arange(3, 53) * 2  # sorted ids, not positions
    items = torch.randn(50, 8, generator=g)
    user = torch.randn(4, 8, generator=g)
    seen_lengths = torch.tensor([3, 0, 5, 1])
    seen_ids = torch.tensor([6, 40, 7, 8, 10, 12, 104, 999, 50])  # 7 and 999: not catalogue ids
    want = corpus[mask_seen(user @ items.T, corpus, seen_ids, seen_lengths).topk(12, dim=1).indices]
    got = chunked_topk(user, items, corpus, seen_ids, seen_lengths, 12, chunk)
    assert torch.equal(got, want)


def test_user_sample_strides_over_the_split():
    assert user_sample(200_000, 2000) == 100 and user_sample(300, 100) == 3 and user_sample(300, 128) == 3
    assert user_sample(300, None) == 1 and user_sample(300, 300) == 1 and user_sample(301, 300) == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
