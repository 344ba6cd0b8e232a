import math

import pytest
import torch

from genrec.train.eval.evaluate import RankingMetrics, target_ranks


def test_metrics_on_hand_computed_ranks():
    m = RankingMetrics(hr_ks=(1, 10), ndcg_ks=(10,))
    m.update(torch.tensor([0, 3, 20]))
    out = m.compute()
    assert out["hr@1"] == pytest.approx(1 / 3)
    assert out["hr@10"] == pytest.approx(2 / 3)
    assert out["ndcg@10"] == pytest.approx((1 + 1 / math.log2(5)) / 3)
    assert out["mrr"] == pytest.approx((1 + 1 / 4 + 1 / 21) / 3)
    assert out["users"] == 3
    # standard errors: sample std of the per-user values over sqrt(users); HR@10 reads
    # [1, 1, 0]: variance ((1/3)^2 * 2 + (2/3)^2) / 2 = 1/3, so se = sqrt(1/3 / 3) = 1/3
    assert out["hr@10_se"] == pytest.approx(1 / 3)
    mrr = torch.tensor([1, 1 / 4, 1 / 21], dtype=torch.float64)
    assert out["mrr_se"] == pytest.approx(float(mrr.std() / math.sqrt(3)))
    assert out["hr@1_se"] == pytest.approx(1 / 3)


def test_metric_state_merges_like_one_pass():
    a, b, whole = RankingMetrics(), RankingMetrics(), RankingMetrics()
    a.update(torch.tensor([0, 5]))
    b.update(torch.tensor([300, 1]))
    whole.update(torch.tensor([0, 5, 300, 1]))
    merged = RankingMetrics()
    merged.load_state(a.state() + b.state())
    assert merged.compute() == pytest.approx(whole.compute())


def test_target_rank_excludes_history():
    corpus = torch.tensor([10, 20, 30, 40, 50])
    # user 0: target 30; items 40 and 50 score higher, 50 was seen -> rank 1
    # user 1: target 20 scores highest; 10 was seen -> rank 0
    scores = torch.tensor([[0.0, 0.1, 0.5, 0.9, 0.8], [0.0, 0.9, 0.5, 0.1, 0.2]])
    ranks = target_ranks(scores, torch.tensor([30, 20]), corpus,
                         torch.tensor([50, 10]), torch.tensor([1, 1]))
    assert ranks.tolist() == [1, 0]
    no_hist = target_ranks(scores, torch.tensor([30, 20]), corpus)
    assert no_hist.tolist() == [2, 0]


def test_a_repeated_target_is_a_miss_when_the_history_is_excluded():
    """Serving leaves the history out of what it returns, so a target that repeats a history
    item can never be served: a miss at every cut-off (rank N), whatever its score. Without
    the history nothing is left out and the same target ranks by its score."""
    corpus = torch.tensor([10, 20, 30, 40, 50])
    scores = torch.tensor([[0.0, 0.9, 0.5, 0.1, 0.2], [0.0, 0.9, 0.5, 0.1, 0.2], [0.0, 0.1, 0.9, 0.2, 0.3]])
    targets = torch.tensor([20, 20, 30])
    # user 0 saw 20 before (a repeat); user 1 saw 10; user 2 saw 30 and 50 (a repeat)
    seen_ids, seen_lengths = torch.tensor([20, 10, 30, 50]), torch.tensor([1, 1, 2])
    assert target_ranks(scores, targets, corpus, seen_ids, seen_lengths).tolist() == [5, 0, 5]
    assert target_ranks(scores, targets, corpus).tolist() == [0, 0, 0]
    m = RankingMetrics(hr_ks=(1, 3), ndcg_ks=(3,))
    m.update(target_ranks(scores, targets, corpus, seen_ids, seen_lengths))
    assert m.compute()["hr@3"] == pytest.approx(1 / 3)


def test_ties_rank_ahead_of_the_target():
    corpus = torch.tensor([10, 20, 30, 40, 50])
    # user 0: 20 and 40 tie with target 30, 50 above -> rank 3; seen 40 drops out -> 2
    # user 1: every item scores the same (a model that cannot tell them apart) -> last
    # user 2: target 20 tied with 10 -> rank 1; seen before (a repeat) -> a miss (5)
    scores = torch.tensor([[0.0, 0.5, 0.5, 0.5, 0.9], [0.3] * 5, [0.7, 0.7, 0.1, 0.1, 0.1]])
    targets = torch.tensor([30, 10, 20])
    assert target_ranks(scores, targets, corpus).tolist() == [3, 4, 1]
    seen = target_ranks(scores, targets, corpus, torch.tensor([40, 20]), torch.tensor([1, 0, 1]))
    assert seen.tolist() == [2, 4, 5]


def test_a_target_outside_the_corpus_is_a_miss_not_an_error():
    """The server never returns an item its model does not know: such a target ranks N (a miss
    at every cut-off), with or without the history, and the other users' ranks stand (it raised,
    and a held-out item no training user had seen ended the whole evaluation)."""
    corpus, scores = torch.tensor([1, 2, 5]), torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.1]])
    targets = torch.tensor([7, 2])  # 7: outside (sorts past the end); and inside, between: 3
    assert target_ranks(scores, targets, corpus).tolist() == [3, 0]
    assert target_ranks(scores, torch.tensor([3, 5]), corpus).tolist() == [3, 2]
    assert target_ranks(scores, targets, corpus, torch.tensor([2]), torch.tensor([0, 1])).tolist() == [3, 3]


def test_transition_baseline_counts_the_models_training_span(tmp_path):
    from genrec.train.data.convert import convert_sequences
    from genrec.train.eval.baselines import Baseline

    src = tmp_path / "seq.txt"
    src.write_text("1 1 2 3 4 5\n2 1 2 3 9 8\n")
    convert_sequences(src, tmp_path / "d")
    corpus = [1, 2, 3, 4, 5, 8, 9]
    strict = Baseline(tmp_path / "d", "transition", valid_users=1.0)  # events[:-2]: 1->2 twice, 2->3 twice
    s = dict(zip(corpus, strict.scores(torch.tensor([2, 3]))[0].tolist()))
    assert s[3] == pytest.approx(2 + 2 / 3) and all(v < 1 for k, v in s.items() if k != 3)
    assert strict.scores(torch.tensor([3])).max() < 1  # nothing follows 3 before the validation events
    through = Baseline(tmp_path / "d", "transition", valid_users=0.0)  # events[:-1] adds 3->4 and 3->9
    t = dict(zip(corpus, through.scores(torch.tensor([3]))[0].tolist()))
    assert t[4] >= 1 and t[9] >= 1 and all(v < 1 for k, v in t.items() if k not in (4, 9))
