"""Transformer tower, retrieval head and the whole recommender on small random batches."""

import pytest
import torch
import torch.nn.functional as F
from torchrec import KeyedJaggedTensor

from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.kernels.jagged import lengths_to_offsets
from genrec.models.hstu import JaggedMeta
from genrec.models.inputs import SequenceBatch
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.models.retrieval import RetrievalConfig, RetrievalHead
from genrec.models.transformer import TransformerConfig, TransformerTower


def test_transformer_rows_do_not_depend_on_batch_mates_and_grads_are_finite():
    torch.manual_seed(0)
    tower = TransformerTower(TransformerConfig(num_layers=2, num_heads=2, dropout=0.0), 16, 32).double()
    lengths = torch.tensor([4, 1, 6])
    x = torch.randn(int(lengths.sum()), 16, dtype=torch.float64, requires_grad=True)
    out = tower(x, JaggedMeta(lengths_to_offsets(lengths), 6, None, None, None))
    alone = tower(x[5:11], JaggedMeta(lengths_to_offsets(torch.tensor([6])), 6, None, None, None))
    torch.testing.assert_close(out[5:11], alone)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    # causal: the first row of a sequence ignores later rows
    first = tower(x[5:6], JaggedMeta(lengths_to_offsets(torch.tensor([1])), 1, None, None, None))
    torch.testing.assert_close(out[5], first[0])


def test_full_softmax_is_cross_entropy_over_the_corpus():
    head = RetrievalHead(RetrievalConfig(loss="full_softmax", temperature=0.5))
    table = torch.randn(10, 4)
    corpus = torch.tensor([1, 3, 4, 8])
    users, targets = torch.randn(5, 4), torch.tensor([3, 8, 1, 1, 4])
    loss = head.loss(users, targets, corpus, lambda ids: table[ids])
    logits = F.normalize(users, dim=-1) @ F.normalize(table[corpus], dim=-1).t() / 0.5
    torch.testing.assert_close(loss, F.cross_entropy(logits, torch.tensor([1, 3, 0, 0, 2])))


def test_full_softmax_runs_its_gemms_in_the_autocast_dtype():
    """Under bf16 autocast (train.precision = "bf16") the head's full softmax takes bf16 GEMMs
    (the kernel's gemm_dtype), its loss within bf16 rounding of fp32; fp32 outside autocast."""
    from genrec.kernels.softmax_ce import softmax_cross_entropy

    g = torch.Generator().manual_seed(2)
    head = RetrievalHead(RetrievalConfig(loss="full_softmax", temperature=0.07))
    table, corpus = torch.randn(300, 32, generator=g), torch.arange(300)
    users, targets = torch.randn(64, 32, generator=g), torch.randint(300, (64,), generator=g)
    lookup = lambda ids: table[ids]  # noqa: E731
    u, it = F.normalize(users, dim=-1), F.normalize(table, dim=-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = head.loss(users, targets, corpus, lookup)
    assert low.dtype == torch.float32
    assert low.item() == softmax_cross_entropy(u, it, targets, 1 / 0.07, gemm_dtype=torch.bfloat16).item()
    exact = head.loss(users, targets, corpus, lookup)
    assert exact.item() == pytest.approx(F.cross_entropy(u @ it.t() / 0.07, targets).item(), rel=1e-5)
    assert low.item() != exact.item() and low.item() == pytest.approx(exact.item(), rel=1e-2)


def test_prefix_pairs_list_each_event_with_its_history_so_far():
    from genrec.models.retrieval import prefix_pairs

    rows, cols = prefix_pairs(torch.tensor([2, 1, 0, 3]))
    assert rows.tolist() == [0, 1, 1, 2, 3, 4, 4, 5, 5, 5]
    assert cols.tolist() == [0, 0, 1, 2, 3, 3, 4, 3, 4, 5]
    rows, cols = prefix_pairs(torch.tensor([0, 0]))
    assert rows.numel() == cols.numel() == 0


def test_exclude_history_leaves_the_history_so_far_out_of_each_softmax():
    """Sequences [1, 3, 4] and [8, 3]: row (sequence, position) leaves out the items up to
    and including its own event, except its target (row 3's 8 targets 8 again, an item the
    user already had: it stays in that row's softmax)."""
    head = RetrievalHead(RetrievalConfig(loss="full_softmax", temperature=0.5, exclude_history=True))
    table = torch.randn(10, 4)
    corpus = torch.tensor([1, 3, 4, 8, 9])
    users = torch.randn(5, 4)
    ids, lengths = torch.tensor([1, 3, 4, 8, 3]), torch.tensor([3, 2])
    targets = torch.tensor([3, 4, 9, 8, 1])
    loss = head.loss(users, targets, corpus, lambda x: table[x], (ids, lengths))
    logits = F.normalize(users, dim=-1) @ F.normalize(table[corpus], dim=-1).t() / 0.5
    seen = [[0], [0, 1], [0, 1, 2], [], [3, 1]]  # columns: 1 -> 0, 3 -> 1, 4 -> 2, 8 -> 3
    for r, cols in enumerate(seen):
        logits[r, cols] = float("-inf")
    torch.testing.assert_close(loss, F.cross_entropy(logits, torch.tensor([1, 2, 4, 3, 0])))
    # a catalogue that is not one run of ids goes through the search; unknown ids are skipped
    wide = torch.cat([corpus, torch.tensor([12])])
    table = torch.cat([table, torch.randn(3, 4)])
    loss = head.loss(users, targets, wide, lambda x: table[x], (torch.tensor([1, 3, 4, 8, 11]), lengths))
    logits = F.normalize(users, dim=-1) @ F.normalize(table[wide], dim=-1).t() / 0.5
    for r, cols in enumerate([[0], [0, 1], [0, 1, 2], [], [3]]):
        logits[r, cols] = float("-inf")
    torch.testing.assert_close(loss, F.cross_entropy(logits, torch.tensor([1, 2, 4, 3, 0])))
    with pytest.raises(ValueError, match="history items"):
        head.loss(users, targets, corpus, lambda x: table[x])
    with pytest.raises(ValueError, match="full_softmax"):
        RetrievalConfig(exclude_history=True)


def test_recommender_excludes_the_history_when_configured():
    torch.manual_seed(0)
    emb = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=16, num_embeddings=50),))
    b = batch([1, 2, 3, 4, 5, 6], [4, 2], [2, 3, 4, 5, 6, 7])
    losses = []
    for exclude in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(max_seq_len=8, input_dropout=0.0,
                          retrieval=RetrievalConfig(loss="full_softmax", exclude_history=exclude))
        model = GenerativeRecommender(cfg, emb, torch.arange(1, 50)).eval()
        losses.append(model(b)["retrieval"])
    assert losses[1] < losses[0]


@pytest.mark.parametrize("negatives", ["uniform", "in_batch", "mixed"])
def test_sampled_softmax_never_counts_the_positive_as_a_negative(negatives):
    head = RetrievalHead(RetrievalConfig(negatives=negatives, num_negatives=64, logq_correction=True))
    table = torch.randn(3, 4)
    corpus = torch.tensor([0, 1, 2])
    # every user vector equals its target row: if a positive leaked in as a negative the loss
    # would be at least log(2) per row
    targets = torch.tensor([0, 1, 2, 1])
    users = F.normalize(table[targets], dim=-1) * 100
    loss = head.loss(users, targets, corpus, lambda ids: table[ids])
    assert torch.isfinite(loss)
    assert loss < 1.0


def tiny_model(tower="hstu"):
    torch.manual_seed(0)
    emb = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=16, num_embeddings=50),))
    cfg = ModelConfig(tower=tower, max_seq_len=8, input_dropout=0.0)
    return GenerativeRecommender(cfg, emb, torch.arange(1, 50))


def batch(values, lengths, targets, has_time=None):
    t = len(values)
    return SequenceBatch(
        seq=KeyedJaggedTensor(keys=["item"], values=torch.tensor(values), lengths=torch.tensor(lengths)),
        max_len=max(lengths), timestamps=torch.arange(t) * 100, query_times=torch.arange(t) * 100 + 50,
        has_time=torch.tensor(has_time or [True] * len(lengths)), targets=torch.tensor(targets))


@pytest.mark.parametrize("tower", ["hstu", "transformer"])
def test_recommender_trains_and_scores(tower):
    model = tiny_model(tower)
    b = batch([1, 2, 3, 4, 5, 6], [4, 2], [2, 3, 4, 5, 6, 7])
    loss = model(b)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and model.sparse.ec.embeddings["item"].weight.grad is not None
    model.eval()
    users = model.user_embeddings(b)
    assert users.shape == (2, 16)
    torch.testing.assert_close(users.norm(dim=-1), torch.ones(2))
    items = model.item_embeddings(model.corpus_ids)
    assert model.head.scores(users, items).shape == (2, 49)


def test_sequences_longer_than_max_seq_len_are_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        model(batch(list(range(1, 11)), [10], list(range(2, 12))))["loss"]


def test_missing_timestamps_fall_back_to_positions():
    model = tiny_model().eval()
    b = batch([1, 2, 3], [3], [2, 3, 4], has_time=[False])
    b_pos = batch([1, 2, 3], [3], [2, 3, 4])
    b_pos.timestamps, b_pos.query_times = torch.arange(3), torch.arange(3) + 1
    torch.testing.assert_close(model.user_embeddings(b), model.user_embeddings(b_pos))


def test_dropout_keeps_one_minus_p_scaled_and_passes_gradients_through_the_kept_elements():
    from genrec.models.dropout import Dropout

    torch.manual_seed(0)
    x = torch.randn(400, 250, requires_grad=True)
    drop = Dropout(0.2)
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.005  # 100k draws: sd 0.0013
    torch.testing.assert_close(y[kept], x[kept] / 0.8)
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.8)
    drop.eval()
    assert drop(x) is x
    assert torch.equal(Dropout(1.0).train()(x), torch.zeros_like(x)) and Dropout(0.0).train()(x) is x
