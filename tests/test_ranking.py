"""Ranking: candidate isolation, history-once equivalence, labels and time split, metrics."""

import math

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor

from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.models.dlrm import PooledDLRM
from genrec.models.inputs import SequenceBatch
from genrec.models.ranking import RankingConfig, TaskConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.train.data.reader import SequenceReader, ranking_cutoffs
from genrec.train.data.samples import RankingDataConfig
from genrec.train.data.schema import read_info
from genrec.train.eval.ranking_metrics import auc, gauc, logloss, normalized_entropy

TASKS = (TaskConfig("click", ("click",)), TaskConfig("conversion", ("conversion",), weight=0.5))


def emb_cfg(context=True):
    tables = [TableConfig("item", ("item",), dim=16, num_embeddings=40),
              TableConfig("action", ("action",), dim=16, num_embeddings=8)]
    if context:
        tables.append(TableConfig("region", ("region",), dim=4, num_embeddings=5, pooling="sum"))
    return EmbeddingConfig(tables=tuple(tables))


def model(tower="hstu", encoding="summed"):
    torch.manual_seed(0)
    cfg = ModelConfig(tower=tower, max_seq_len=24, input_dropout=0.0,
                      ranking=RankingConfig(tasks=TASKS, encoding=encoding, dropout=0.0))
    m = GenerativeRecommender(cfg, emb_cfg(), torch.arange(1, 40))
    return m.eval()


def make_batch(users):
    """users: list of (history items, history actions, candidate items)."""
    items, acts, lens, nts, times, qtimes = [], [], [], [], [], []
    for hist, hact, cands in users:
        items += hist + cands
        acts += hact + [0] * len(cands)
        lens.append(len(hist) + len(cands))
        nts.append(len(cands))
        request = 100 * len(hist) + 30  # as the reader does: history event i is queried at
        times += [100 * i for i in range(len(hist))] + [request] * len(cands)  # event i + 1's time,
        qtimes += [100 * (i + 1) for i in range(len(hist) - 1)] + [request] * (len(cands) + 1)  # the last one
    n = len(lens)  # and every candidate at the request time
    return SequenceBatch(
        seq=KeyedJaggedTensor(keys=["item", "action"], values=torch.tensor(items + acts), lengths=torch.tensor(lens * 2)),
        max_len=max(lens), timestamps=torch.tensor(times), query_times=torch.tensor(qtimes),
        has_time=torch.ones(n, dtype=torch.bool),
        num_targets=torch.tensor(nts), user_ids=torch.arange(n),
        context=KeyedJaggedTensor(keys=["region"], values=torch.arange(n) % 5, lengths=torch.ones(n, dtype=torch.long)),
        targets=torch.zeros(0, dtype=torch.long), labels=torch.zeros(sum(nts), 2))


HIST, HACT = [3, 7, 1, 9, 4], [1, 3, 1, 7, 1]


@pytest.mark.parametrize("tower,encoding", [("hstu", "summed"), ("hstu", "interleaved"), ("transformer", "summed")])
def test_a_candidates_score_does_not_depend_on_the_other_candidates(tower, encoding):
    m = model(tower, encoding)
    a = m.rank(make_batch([(HIST, HACT, [11, 12, 13, 14])]))
    b = m.rank(make_batch([(HIST, HACT, [11, 30, 13, 31])]))
    torch.testing.assert_close(a[[0, 2]], b[[0, 2]])
    assert not torch.allclose(a[1], b[1])


@pytest.mark.parametrize("tower,encoding", [("hstu", "summed"), ("hstu", "interleaved"), ("transformer", "summed")])
def test_history_encoded_once_scores_like_once_per_candidate(tower, encoding):
    m = model(tower, encoding)
    cands = [11, 12, 13, 14, 15]
    together = m.rank(make_batch([(HIST, HACT, cands)]))
    alone = torch.cat([m.rank(make_batch([(HIST, HACT, [c])])) for c in cands])
    torch.testing.assert_close(together, alone)
    # and a batch of users scores each user as if alone
    pair = m.rank(make_batch([(HIST, HACT, cands), ([5, 6], [1, 1], [11])]))
    torch.testing.assert_close(pair[:5], together)


def test_joint_loss_has_every_part_and_the_retrieval_loss_ignores_candidates():
    m = model()
    m.train()
    b = make_batch([(HIST, HACT, [11, 12]), ([5, 6, 8], [1, 3, 1], [13])])
    b.targets = torch.tensor([7, 1, 9, 4, 11, 6, 8, 13])
    b.labels = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    torch.manual_seed(1)
    out = m(b)
    assert set(out) == {"loss", "retrieval", "ranking", "click", "conversion"}
    torch.testing.assert_close(out["ranking"], out["click"] + 0.5 * out["conversion"])
    out["loss"].backward()
    b2 = make_batch([(HIST, HACT, [20, 21]), ([5, 6, 8], [1, 3, 1], [22])])
    b2.targets, b2.labels = b.targets, b.labels
    torch.manual_seed(1)
    torch.testing.assert_close(m(b2)["retrieval"], out["retrieval"])


def taste_batch(gen, users):
    """``users`` users who each like one half of the items (1-19 or 20-39): a history of 5 of
    them, 4 random candidates; click = the candidate is in the user's half, conversion = a
    click on an odd item. Learning click needs the history and the candidate together."""
    rows, labels = [], []
    for _ in range(users):
        half = int(gen.integers(2))
        lo, hi = (1, 20) if half == 0 else (20, 40)
        hist = gen.integers(lo, hi, 5).tolist()
        cands = gen.integers(1, 40, 4).tolist()
        rows.append((hist, gen.integers(1, 8, 5).tolist(), cands))
        labels += [[float(lo <= c < hi), float(lo <= c < hi and c % 2 == 1)] for c in cands]
    b = make_batch(rows)
    b.labels = torch.tensor(labels)
    return b


def test_dlrm_baseline_learns_what_its_pooled_features_carry():
    """Trained on the batches the sequential model ranks, the baseline's held-out click AUC is
    far above chance and its log loss beats the best constant predictor (the base rate)."""
    torch.manual_seed(0)
    gen = np.random.default_rng(0)
    d = PooledDLRM(RankingConfig(tasks=TASKS, dropout=0.0, hidden=(32,)), emb_cfg())
    held_out = taste_batch(np.random.default_rng(1), 256)
    opt = torch.optim.Adam(d.parameters(), lr=0.1)
    losses = []
    for _ in range(15):
        d.train()
        loss = d(taste_batch(gen, 64))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    d.eval()
    with torch.no_grad():
        p = d.rank(held_out).numpy()
    y = held_out.labels.numpy()
    assert p.shape == y.shape == (1024, 2)
    assert auc(p[:, 0], y[:, 0]) > 0.9
    for t in range(2):
        constant = logloss(np.full(len(y), y[:, t].mean()), y[:, t])
        assert logloss(p[:, t], y[:, t]) < 0.6 * constant, t


def test_a_pooled_table_of_several_features_gives_each_feature_its_own_context_vector():
    """A pooled table read by two features (device and app language, say) pools each on its
    own: the ranking heads take both vectors, and the second one changes the scores."""
    tables = (*emb_cfg(context=False).tables, TableConfig("lang", ("device_lang", "app_lang"), dim=4, num_embeddings=6,
                                                          pooling="sum"))
    ecfg = EmbeddingConfig(tables=tables)
    b = make_batch([(HIST, HACT, [11, 12]), ([5, 6], [1, 1], [13])])
    b.labels = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])

    def ctx(app):
        return KeyedJaggedTensor(keys=["device_lang", "app_lang"], values=torch.tensor([1, 2, *app]),
                                 lengths=torch.ones(4, dtype=torch.long))

    torch.manual_seed(0)
    gen = GenerativeRecommender(ModelConfig(tower="hstu", max_seq_len=24, input_dropout=0.0,
                                            ranking=RankingConfig(tasks=TASKS, dropout=0.0)), ecfg, torch.arange(1, 40))
    torch.manual_seed(0)
    dlrm = PooledDLRM(RankingConfig(tasks=TASKS, dropout=0.0), ecfg)
    for m in (gen.eval(), dlrm.eval()):
        with torch.no_grad():
            b.context = ctx([3, 4])
            a = m.rank(b)
            b.context = ctx([5, 4])
            assert a.shape == (3, 2) and not torch.allclose(a[:2], m.rank(b)[:2])
        m.train()
        m.rank(b).sum().backward()


def test_ranking_reader_labels_and_time_split(tiny_synth):
    info = read_info(tiny_synth)
    masks = RankingConfig(tasks=TASKS).task_masks(info.action_names)
    assert masks == {"click": 2, "conversion": 4}
    e = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=info.item_table_size),
                                TableConfig("action", ("action",), dim=8, num_embeddings=8)))
    rk = RankingDataConfig(enabled=True, num_candidates=4, test_fraction=0.1)
    lo, hi = ranking_cutoffs(tiny_synth, 0.1)
    kw = dict(embedding=e, max_seq_len=20, batch_size=16, ranking=rk, tasks=masks)
    candidates = 0
    for b in SequenceReader(tiny_synth, "train", **kw):
        assert int(b.timestamps.max()) < lo and int(b.query_times.max()) < lo  # nothing held out is an input
        if b.num_targets is not None:
            acts = b.seq["action"].values()
            n = b.seq.lengths()[: b.batch_size]
            last = torch.cumsum(n, 0) - 1
            assert (acts[last[b.num_targets > 0]] == 0).all()  # candidates carry no action
            assert b.labels.shape == (int(b.num_targets.sum()), 2)
            assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
            assert (b.labels[:, 1] <= b.labels[:, 0]).all()  # a conversion is a clicked candidate's
            candidates += int(b.num_targets.sum())
    assert candidates > 0  # the checks above ran
    seen = 0
    for b in SequenceReader(tiny_synth, "rank_test", **kw):
        starts = torch.cumsum(b.seq.lengths()[: b.batch_size], 0) - b.num_targets
        assert int(b.timestamps[starts].min()) >= hi  # candidates are in the test period
        assert not torch.isnan(b.oracle).any()
        seen += int(b.num_targets.sum())
    assert seen > 0


def test_ranking_evaluation_reads_the_history_a_served_rank_reads(tiny_synth):
    """A served Rank keeps history_capacity events before its candidates (they share one
    position after it), however many candidates it has; the ranking evaluation keeps the same,
    not max_seq_len minus the candidates (it read 12 events where the server read 15)."""
    from genrec.serve.layout import history_capacity

    info = read_info(tiny_synth)
    masks = RankingConfig(tasks=TASKS).task_masks(info.action_names)
    e = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=info.item_table_size),
                                TableConfig("action", ("action",), dim=8, num_embeddings=8)))
    rk = RankingDataConfig(enabled=True, num_candidates=4, test_fraction=0.1)
    cap, longest = history_capacity(16, 1, ranked=True), 0
    for b in SequenceReader(tiny_synth, "rank_test", embedding=e, max_seq_len=16, batch_size=16, ranking=rk,
                            tasks=masks):
        hist = b.seq.lengths()[: b.batch_size] - b.num_targets
        assert int(hist.max()) <= cap
        four = hist[b.num_targets == 4]  # requests of 4 candidates
        longest = max(longest, int(four.max()) if four.numel() else 0)
    assert longest == cap == 15


def test_auc_gauc_logloss_ne_on_hand_computed_cases():
    assert auc(np.array([0.9, 0.2, 0.6]), np.array([1, 0, 0])) == 1.0
    assert auc(np.array([0.1, 0.2, 0.6, 0.4]), np.array([1, 0, 1, 0])) == pytest.approx(0.5)
    assert auc(np.array([0.5, 0.5]), np.array([1, 0])) == pytest.approx(0.5)  # ties count half
    assert math.isnan(auc(np.array([0.3]), np.array([1])))
    # user 0: auc 1 over 2 examples; user 1: auc 0 over 4 examples; user 2: one class, skipped
    s = np.array([0.9, 0.1, 0.1, 0.2, 0.8, 0.9, 0.5])
    y = np.array([1, 0, 1, 1, 0, 0, 1])
    u = np.array([0, 0, 1, 1, 1, 1, 2])
    assert gauc(s, y, u) == pytest.approx((1.0 * 2 + 0.0 * 4) / 6)
    p, lab = np.array([0.8, 0.3]), np.array([1, 0])
    assert logloss(p, lab) == pytest.approx(-(math.log(0.8) + math.log(0.7)) / 2)
    assert normalized_entropy(p, lab) == pytest.approx(logloss(p, lab) / math.log(2))


@pytest.mark.parametrize("tower,encoding", [("hstu", "summed"), ("hstu", "interleaved"), ("transformer", "summed")])
def test_cached_history_scores_equal_the_full_pass(tower, encoding):
    """M-FALCON serving: encode histories once, score candidates in micro-batches later."""
    m = model(tower, encoding)
    users = [(HIST, HACT, [11, 12, 13]), ([5, 6], [1, 3], [14, 15]), ([8], [1], [16])]
    full = m.rank(make_batch(users))
    hist_only = make_batch([(h, a, []) for h, a, _ in users])
    hist_only.num_targets = None
    users_vec, state = m.encode_history(hist_only)
    assert users_vec.shape == (3, 16)
    items = torch.tensor([c for _, _, cs in users for c in cs])
    owner = torch.tensor([i for i, (_, _, cs) in enumerate(users) for _ in cs])
    parts = [m.score_candidates(state, items[s], owner[s]) for s in (slice(0, 4), slice(4, 7))]  # micro-batches
    torch.testing.assert_close(torch.cat(parts), full)
    # any order of candidates and users, and the grouped fast case (same count per user, in user order)
    perm = torch.tensor([5, 2, 4, 0, 3, 1])
    torch.testing.assert_close(m.score_candidates(state, items[perm], owner[perm]), full[perm])
    grouped = torch.tensor([0, 1, 3, 4])  # users 0 and 1, two candidates each
    torch.testing.assert_close(m.score_candidates(state, items[grouped], owner[grouped]), full[grouped])


@pytest.mark.parametrize("tower", ["hstu", "transformer"])
def test_a_bf16_dense_model_serves_close_to_fp32(tower):
    """A bf16 serving artifact (dense tower and heads in bf16, embedding rows fp32, as on
    GPU): the rows are cast at the tower's input and the user vectors come back fp32."""
    m = model(tower)
    users = [(HIST, HACT, [11, 12, 13]), ([5, 6], [1, 3], [14, 15])]
    hist_only = make_batch([(h, a, []) for h, a, _ in users])
    hist_only.num_targets = None
    items = torch.tensor([c for _, _, cs in users for c in cs])
    owner = torch.tensor([i for i, (_, _, cs) in enumerate(users) for _ in cs])
    with torch.inference_mode():
        vec32, state32 = m.encode_history(hist_only)
        p32 = m.score_candidates(state32, items, owner)
        for part in (m.tower, m.pos_emb, m.ranking):
            part.to(torch.bfloat16)
        assert m.dense_dtype == torch.bfloat16
        vec16, state16 = m.encode_history(hist_only)
        p16 = m.score_candidates(state16, items, owner)
        full16 = m.rank(make_batch(users))
    assert vec16.dtype == torch.float32 and p16.dtype == torch.float32
    torch.testing.assert_close(vec16, vec32, atol=0.03, rtol=0.03)
    torch.testing.assert_close(p16, p32, atol=0.02, rtol=0.02)
    torch.testing.assert_close(full16, p32, atol=0.02, rtol=0.02)


def test_held_out_events_are_ranked_in_requests_after_every_event_before_them(tiny_synth):
    """A served request sees the log up to its time: each request of num_candidates held-out
    events follows every event before it (earlier held-out events too), so a user who becomes
    active after the cutoff is not ranked on an empty or stale history."""
    import pyarrow.parquet as pq

    info = read_info(tiny_synth)
    masks = RankingConfig(tasks=TASKS).task_masks(info.action_names)
    e = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=info.item_table_size),
                                TableConfig("action", ("action",), dim=8, num_embeddings=8)))
    rk = RankingDataConfig(enabled=True, num_candidates=4, eval_candidates=64, test_fraction=0.1)
    _, hi = ranking_cutoffs(tiny_synth, 0.1)
    rows = {r["user_id"]: r for r in pq.read_table(tiny_synth / "interactions.parquet").to_pylist()}
    expected = {}
    for u, r in rows.items():
        idx = np.flatnonzero(np.asarray(r["timestamps"]) >= hi)
        expected[u] = [idx[c:c + 4] for c in range(0, idx.size, 4) if idx[c] > 0]
    got: dict[int, list[tuple[int, int]]] = {}
    kw = dict(embedding=e, max_seq_len=400, batch_size=16, ranking=rk, tasks=masks)
    for b in SequenceReader(tiny_synth, "rank_test", **kw):
        n = b.seq.lengths()[: b.batch_size].tolist()
        for u, length, k in zip(b.user_ids.tolist(), n, b.num_targets.tolist()):
            got.setdefault(u, []).append((length - k, k))
    assert sum(len(v) for v in expected.values()) > len([v for v in expected.values() if v])  # several per user
    for u, reqs in expected.items():
        # history = every event before the request's first candidate (max_seq_len leaves room)
        assert got.get(u, []) == [(int(i[0]), i.size) for i in reqs], u
