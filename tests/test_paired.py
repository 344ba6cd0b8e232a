"""train/eval/paired.py: per-user ranks that read what the evaluator reads, paired differences."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from genrec.train.eval.evaluate import EvalConfig
from genrec.train.eval.paired import format_paired, paired_difference, rank_metrics


def test_paired_difference_is_the_mean_per_user_difference_and_its_standard_error():
    a, b = {1: 0, 2: 12, 3: 4}, {1: 3, 2: 12, 3: 0, 9: 0}  # user 9: ranked by one side only, left out
    diff = paired_difference(a, b)
    # hr@1: (1 - 0, 0 - 0, 0 - 1) -> mean 0, sd 1; hr@10: (0, 0, 0)
    assert diff["hr@1"] == pytest.approx((0.0, 1 / math.sqrt(3)))
    assert diff["hr@10"] == pytest.approx((0.0, 0.0))
    d = [1 - 1 / math.log2(5), 0.0, 1 / math.log2(6) - 1]
    mean = sum(d) / 3
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 2 / 3)
    assert diff["ndcg@10"] == pytest.approx((mean, se))
    line = format_paired("hstu", "transition baseline", diff, 3)
    assert line.startswith("hstu - transition baseline, paired over 3 users: hr@1 +0.0000 +- 0.5774")
    with pytest.raises(ValueError, match="at least 2 users"):
        paired_difference({1: 0}, {1: 1})


def test_rank_metrics_are_the_evaluators():
    ranks = {5: 0, 6: 3, 7: 40, 8: 5000}
    m = rank_metrics(ranks, EvalConfig())
    assert m["users"] == 4 and m["hr@1"] == pytest.approx(0.25) and m["hr@10"] == pytest.approx(0.5)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(5)) / 4)


def test_baseline_ranks_read_what_evaluate_baseline_reads(tiny_synth):
    from genrec.embedding.spec import EmbeddingConfig, TableConfig
    from genrec.train.data.reader import DataConfig, make_reader
    from genrec.train.data.schema import read_info
    from genrec.train.eval.baselines import Baseline, evaluate_baseline
    from genrec.train.eval.paired import baseline_ranks
    from genrec.train.job import resolve_embedding

    data = DataConfig(path=str(tiny_synth), batch_size=16)
    emb = resolve_embedding(EmbeddingConfig(tables=(TableConfig(name="item", features=("item",), dim=8),)),
                            read_info(tiny_synth))
    for kind in ("popular", "transition"):
        base = Baseline(tiny_synth, kind)
        for cfg in (EvalConfig(), replace(EvalConfig(), exclude_history=False)):
            ranks = baseline_ranks(base, make_reader(data, "test", emb, 32), cfg)
            want = evaluate_baseline(base, make_reader(data, "test", emb, 32), cfg)
            got = rank_metrics(ranks, cfg)
            assert len(ranks) == want["users"] == 300
            assert got == pytest.approx(want, abs=1e-12), kind
    assert torch.tensor(list(ranks.values())).min() >= 0
