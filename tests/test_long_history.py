"""Long histories end to end (issue 32): a model with ``max_seq_len`` 8192 trains on a history
of ~8000 events and serves one, and the history window that moves in blocks keeps its start
between block boundaries (``models.inputs.history_window``, which serving and evaluation
both cut with)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor

from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.models import retrieval
from genrec.models.hstu import HSTUConfig
from genrec.models.inputs import SequenceBatch, history_window
from genrec.models.ranking import RankingConfig, TaskConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.models.retrieval import RetrievalConfig, RetrievalHead
from genrec.train.data.samples import UserEvents, loo_eval

LONG, EVENTS, ITEMS, T0 = 8192, 8000, 8192, 1_700_000_000


def long_model(exclude_history: bool = True) -> GenerativeRecommender:
    torch.manual_seed(0)
    tables = (TableConfig("item", ("item",), dim=32, num_embeddings=ITEMS + 1),
              TableConfig("action", ("action",), dim=32, num_embeddings=4))
    cfg = ModelConfig(max_seq_len=LONG, input_dropout=0.0,
                      hstu=HSTUConfig(num_layers=2, qk_dim=32, v_dim=32, dropout=0.0),
                      retrieval=RetrievalConfig(loss="full_softmax", temperature=0.07, exclude_history=exclude_history),
                      ranking=RankingConfig(tasks=(TaskConfig("click", ("click",)),), hidden=(16,), dropout=0.0))
    return GenerativeRecommender(cfg, EmbeddingConfig(tables=tables), torch.arange(1, ITEMS + 1))


def long_history(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n distinct items (as ML-1M's ratings are: with repeats a small catalogue is soon all
    seen, and the later positions' softmax, without the history's items, holds only the target)."""
    rng = np.random.default_rng(seed)
    return rng.permutation(ITEMS)[:n] + 1, T0 + np.cumsum(rng.integers(0, 4000, n)), rng.integers(0, 4, n)


def test_a_training_step_at_max_seq_len_8192_reaches_the_far_positions(monkeypatch):
    """One history of 8000 events (the recipe's full softmax without the history's items): the
    loss and every gradient are finite, the relative position bias and the position embedding
    learn at distances past 4096, and the exclusion pairs (L^2 / 2 of them) are listed in
    runs of a bounded size, not all 32M at once."""
    model = long_model()
    items, times, actions = long_history(EVENTS + 1)
    batch = SequenceBatch(
        seq=KeyedJaggedTensor(["item", "action"], torch.from_numpy(np.concatenate([items[:-1], actions[:-1]])),
                              lengths=torch.tensor([EVENTS, EVENTS])),
        max_len=EVENTS, timestamps=torch.from_numpy(times[:-1]), query_times=torch.from_numpy(times[1:]),
        has_time=torch.tensor([True]), targets=torch.from_numpy(items[1:]))
    listed = []
    ce = retrieval.softmax_cross_entropy
    monkeypatch.setattr(retrieval, "softmax_cross_entropy",
                        lambda *a, exclude=None, **k: listed.append(exclude.numel()) or ce(*a, exclude=exclude, **k))
    loss = model(batch)["loss"]
    loss.backward()
    assert torch.isfinite(loss)
    assert max(listed) <= retrieval.EXCLUDE_CHUNK_PAIRS < sum(listed) == EVENTS * (EVENTS + 1) // 2
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    assert model.tower.layers[0].pos_weights.grad[5000:EVENTS].abs().sum() > 0
    assert model.pos_emb.weight.grad[EVENTS - 1].abs().sum() > 0
    assert model.pos_emb.weight.grad[EVENTS:].abs().sum() == 0


def test_exclusion_in_runs_gives_the_loss_and_gradients_of_one_run(monkeypatch):
    """Rows cut into runs mid-sequence, ids outside the catalogue among them: the same loss
    and gradients as all rows in one call."""
    torch.manual_seed(1)
    head = RetrievalHead(RetrievalConfig(loss="full_softmax", temperature=0.5, exclude_history=True))
    table = torch.randn(30, 8, requires_grad=True)
    corpus = torch.arange(1, 25)
    lengths = torch.tensor([7, 0, 12, 1, 9])
    ids = torch.randint(1, 28, (int(lengths.sum()),))  # 25..27: not in the catalogue
    targets = torch.randint(1, 25, (ids.numel(),))
    users = torch.randn(ids.numel(), 8, requires_grad=True)

    def run() -> tuple[torch.Tensor, ...]:
        loss = head.loss(users, targets, corpus, lambda x: table[x], (ids, lengths))
        return (loss, *torch.autograd.grad(loss, (users, table)))

    whole = run()
    monkeypatch.setattr(retrieval, "EXCLUDE_CHUNK_PAIRS", 10)
    runs = list(head._seen((ids, lengths), corpus))
    assert len(runs) > 3 and [a for a, _, _ in runs[1:]] == [b for _, b, _ in runs[:-1]]
    for got, want in zip(run(), whole):
        torch.testing.assert_close(got, want)


def test_an_8000_event_history_is_served(tmp_path):
    """Quantized artifact -> TorchEngine: a Rank request with 200 candidates and an 8000-event
    history (over the server's default limit of 4096: the deployer raises it) is ranked as the
    float model ranks the candidates after the same history."""
    from genrec.config import to_dict
    from genrec.proto.v1 import recommender_pb2 as pb
    from genrec.quant.artifact import Manifest, save_artifact
    from genrec.quant.convert import QuantizeConfig
    from genrec.quant.dense import dense_tensors
    from genrec.quant.embeddings import table_tensors
    from genrec.serve.engine import TorchEngine, collate_users
    from genrec.serve.requests import InvalidRequest, Limits, decode

    model = long_model().eval()
    q = QuantizeConfig(embeddings="fp16")
    art = tmp_path / "art"
    save_artifact(art, Manifest(to_dict(model.cfg), to_dict(model.embedding_cfg),
                                {"embeddings": q.embeddings, "dense": q.dense, "row_alignment": q.row_alignment}),
                  {"embeddings.safetensors": table_tensors(model.sparse, q.embeddings),
                   "dense.safetensors": dense_tensors(model, q.dense)})
    items, times, actions = long_history(EVENTS, seed=2)
    req = pb.RankRequest()
    for i, t, a in zip(items, times, actions):
        req.user.history.add(item_id=int(i), timestamp=int(t), actions=int(a))
    cands = np.random.default_rng(3).integers(1, ITEMS + 1, 200)
    for c in cands:
        req.candidates.add(item_id=int(c), bid=1.0)
    engine = TorchEngine(art)
    assert engine.schema.max_history == LONG - 1
    with pytest.raises(InvalidRequest, match="history"):
        decode("rank", req.SerializeToString(), engine.schema, Limits(max_history=4096))
    assert Limits().max_history == 16384  # the API's default: ads users' histories of 10^4 events
    work = decode("rank", req.SerializeToString(), engine.schema, Limits())
    (res,) = engine.run([work])
    assert sorted(res.item_ids.tolist()) == sorted(cands.tolist())
    with torch.inference_mode():
        batch = collate_users([work.user], model, torch.device("cpu"), [work.candidates])
        want = model.rank(batch)[:, 0].numpy()
    got = dict(zip(res.item_ids.tolist(), res.tasks["click"].tolist()))
    np.testing.assert_allclose([got[int(c)] for c in cands], want, atol=2e-3)


@pytest.mark.parametrize("cap,block", [(200, 1), (200, 8), (200, 32), (200, 200), (7, 3), (8, 8)])
def test_the_window_moves_only_in_steps_of_its_block(cap, block):
    starts = [history_window(n, cap, block) for n in range(1, 3 * cap + 2 * block)]
    for n, s in enumerate(starts, 1):
        assert s % block == 0 and s >= 0
        assert (n - s == n) if n <= cap else (cap - block + 1 <= n - s <= cap)
    # a growing history keeps its start until the window would pass cap events: then it moves by one block
    for prev, nxt in zip(starts, starts[1:]):
        assert nxt in (prev, prev + block)
    if block == 1:
        assert starts == [max(0, n - cap) for n in range(1, len(starts) + 1)]
    for bad in (0, cap + 1):
        with pytest.raises(ValueError, match="block"):
            history_window(10, cap, bad)


def test_evaluation_reads_the_window_a_block_leaves():
    """The valid / test sample of a long history starts where the serving window starts; its
    seen items (excluded from the ranking) are the whole history still."""
    n = 250
    ev = UserEvents(7, np.arange(1, n + 1), T0 + np.arange(n), None)
    today, blocked = loo_eval(ev, n - 1, 200), loo_eval(ev, n - 1, 200, block=32)
    assert today.items[0] == ev.items[n - 1 - 200] and today.items.size == 200
    start = history_window(n - 1, 200, 32)
    assert blocked.items[0] == ev.items[start] and blocked.items.size == n - 1 - start < 200
    assert blocked.targets.tolist() == [ev.items[n - 1]]
    assert blocked.seen.size == today.seen.size == n - 1
    assert (blocked.qtimes[-1], blocked.times[0]) == (ev.times[n - 1], ev.times[start])


def test_the_config_cuts_the_readers_validation_and_test_windows(tiny_synth):
    """``data.eval_window_block`` reaches the valid and test readers (and only changes histories
    longer than the window); a block wider than the window is refused, naming the key."""
    from dataclasses import replace

    from genrec.train.data.reader import DataConfig, make_reader

    emb = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=601),))

    def windows(split: str, block: int) -> dict[int, tuple[int, int]]:
        """{user: (history events read, events before the target)}"""
        cfg = replace(DataConfig(path=str(tiny_synth)), eval_window_block=block)
        return {u: (int(n), int(s)) for b in make_reader(cfg, split, emb, 16)
                for u, n, s in zip(b.user_ids.tolist(), b.lengths, b.seen_lengths)}

    for split in ("valid", "test"):
        today, blocked = windows(split, 1), windows(split, 8)
        assert today.keys() == blocked.keys()
        assert any(s > 16 for _, s in today.values())
        for u, (n, seen) in blocked.items():
            assert n == seen - history_window(seen, 16, 8) and today[u] == (min(seen, 16), seen)
    with pytest.raises(ValueError, match="data.eval_window_block"):
        make_reader(replace(DataConfig(path=str(tiny_synth)), eval_window_block=17), "valid", emb, 16)
    # a ranking model's window is one event shorter (its candidates' position): a block of the
    # whole sequence is refused up front, not at the first validation batch
    from genrec.train.data.reader import SequenceReader

    with pytest.raises(ValueError, match=r"events the tower reads \(15\), got 16"):
        SequenceReader(tiny_synth, "valid", embedding=emb, max_seq_len=16, batch_size=8, tasks={"click": 2},
                       window_block=16)


def test_the_recipe_check_names_the_model_fields_a_run_changed():
    from genrec.benchmarks.long_history import recipe_check
    from genrec.train.job import load_job

    recipe = load_job("configs/hstu.toml", ['--data.path="data/ml1m"'])
    other = recipe.model.hstu.dropout + 0.25
    run = load_job("configs/hstu.toml", ['--data.path="data/ml1m"', f"--model.hstu.dropout={other}", "--run.name=x"])
    assert recipe_check(recipe, recipe) == {"ml1m_hstu_recipe_model": True, "differences": {}}
    assert recipe_check(run, recipe) == {"ml1m_hstu_recipe_model": False, "differences": {
        "model.hstu.dropout": {"run": other, "recipe": recipe.model.hstu.dropout}}}


def test_long_quality_queries_put_each_resumed_event_after_its_whole_history(tmp_path):
    """benchmarks/long_quality: a resumed query, read as the evaluator reads the test split,
    predicts the resumed item from every event before it (up to the tower's 8,192), and the
    config's three variants load."""
    from dataclasses import replace

    from genrec.benchmarks import long_quality as lq
    from genrec.train.data.reader import DataConfig, make_reader
    from genrec.train.data.schema import read_info
    from genrec.train.data.synthetic import SyntheticWorld, _users_chunk, generate
    from genrec.train.job import load_job, resolve_embedding

    cfg = replace(lq.synth_config(6), long_len=3000, long_quiet=300, long_return=0.02)
    cols = _users_chunk(SyntheticWorld(cfg), np.random.default_rng(0), 1, cfg.num_users)[0]
    q = lq.queries(cols, range(2, 6))
    resumed = [(cols["user_id"][i], t) for i in range(2, 6) for t in np.flatnonzero(cols["resumed"][i])]
    assert len(resumed) >= 4 and len(q["resumed"]["user_id"]) == len(resumed) and len(q["last"]["user_id"]) == 4
    lq.write_rows(tmp_path / "q", q["resumed"])
    emb = resolve_embedding(load_job(str(lq.ROOT / lq.CONFIG), []).embedding, read_info(tmp_path / "q"))
    reader = make_reader(DataConfig(path=str(tmp_path / "q"), eval_batch_size=3), "test", emb, 8192)
    seen = {}
    for batch in reader:
        for u, target, n in zip(batch.user_ids.tolist(), batch.targets.tolist(), batch.lengths.tolist()):
            seen[u] = (target, n)
    for k, (uid, t) in enumerate(resumed):
        qid = q["resumed"]["user_id"][k]
        assert qid // 64 == uid
        items = cols["item_ids"][uid - 1]
        assert seen[qid] == (items[t], t)  # the resumed item, after all t events before it
    # the generator's process: a resumed item has a probability only where the distant past is
    # read (its topic is never among the last 512 events, nor the current one): the bottom rank
    # (ties against it) from the window, above it from the whole history
    cfg = replace(cfg, long_quiet=600)
    cols = _users_chunk(SyntheticWorld(cfg), np.random.default_rng(0), 1, cfg.num_users)[0]
    near, far = (lq.process_ranks(cols, range(6), d, cfg) for d in (False, True))
    assert len(far["resumed"]) >= 6 and set(near["resumed"].values()) == {4095}
    assert max(far["resumed"].values()) < 1000
    # the comparison's reference rows from the generator's rows on disk (no model: no run to read)
    generate(replace(cfg, num_users=6), tmp_path / "all", progress=False)
    got = lq.compare({}, tmp_path, "valid", lq.read_rows(tmp_path / "all"), range(6), cfg, per_user=2)
    assert set(got) == set(lq.SETS) and set(got["resumed"]) == {"process_full", "process_window"}
    assert got["resumed"]["process_window"]["hr@50"] == 0.0 < got["resumed"]["process_full"]["hr@50"]
    for name, over in lq.VARIANTS.items():
        job = load_job(str(lq.ROOT / lq.CONFIG), over)
        assert (job.model.hstu.window, job.model.max_seq_len) == {"full": (0, 8192), "bounded": (512, 8192),
                                                                  "window": (512, 512)}[name]


def test_long_ranking_requests_open_at_each_resumed_event_after_its_whole_history(tmp_path):
    """benchmarks/long_ranking: each request, read as the model reads it, ranks the 16 events
    from a resumed event on after every event before it (up to the tower's capacity), labelled
    from their actions; the resumed flags line up with the candidates read; a model compared
    with itself differs by zero; the config's three variants load."""
    from dataclasses import replace

    from genrec.benchmarks import long_ranking as lr
    from genrec.train.data.schema import read_info
    from genrec.train.data.synthetic import SyntheticWorld, _users_chunk
    from genrec.train.eval.ranking_metrics import RankingPredictions
    from genrec.train.job import load_job, resolve_embedding

    cfg = replace(lr.synth_config(6, topics=64, long_return=0.2), long_len=3000, long_quiet=300)
    cols = _users_chunk(SyntheticWorld(cfg), np.random.default_rng(0), 1, cfg.num_users)[0]
    rows, flags = lr.held_out(cols, range(2, 6))
    want = {64 * cols["user_id"][i] + k: (cols["user_id"][i], int(t)) for i in range(2, 6)
            for k, t in enumerate(np.flatnonzero(cols["resumed"][i])[: lr.PER_USER])}
    assert len(want) >= 8 and list(flags) == list(want) == rows["user_id"]
    lr._write(tmp_path / "q", rows)
    job = load_job(str(lr.ROOT / lr.CONFIG), [f'--data.path="{tmp_path / "q"}"', "--data.eval_batch_size=3"])
    emb = resolve_embedding(job.embedding, read_info(tmp_path / "q"))
    read = {}
    labels, users = [], []
    for batch in lr.requests(job, emb, tmp_path / "q"):
        starts = np.cumsum(batch.lengths.numpy()) - batch.lengths.numpy()
        items = batch.seq[emb.item_feature].values().numpy()
        for u, s, n, k in zip(batch.user_ids.tolist(), starts, batch.lengths.tolist(), batch.num_targets.tolist()):
            read[u] = (n - k, items[s + n - k : s + n])
        labels.append(batch.labels.numpy())
        users.append(np.repeat(batch.user_ids.numpy(), batch.num_targets.numpy()))
    for qid, (uid, t) in want.items():
        hist, cand = read[qid]
        events = cols["item_ids"][uid - 1]
        assert hist == t and list(cand) == list(events[t : t + 16])  # every event before the resumed one
        assert flags[qid][0] and flags[qid].size == 16
        assert list(flags[qid]) == [bool(x) for x in cols["resumed"][uid - 1][t : t + 16]]
    y, ids = np.concatenate(labels), np.concatenate(users)
    for qid, (uid, t) in want.items():  # each candidate labelled by its own event's click
        assert list(y[ids == qid, 0]) == list(np.asarray(cols["actions"][uid - 1][t : t + 16]) & 2 != 0)
    scores = np.random.default_rng(1).random(y.shape).astype(np.float32)
    pred = RankingPredictions(scores, scores, y, np.concatenate(users), oracle=scores)
    resumed, owner = lr._per_user(pred, flags)
    assert resumed.sum() == sum(f.sum() for f in flags.values()) and owner.max() == 3
    got = lr.compare({"full": pred, "bounded": pred}, flags, draws=5)
    for name in lr.SUBSETS:
        assert got["click"][name]["bounded"]["vs_full"] == {"difference": 0.0, "se": 0.0}
    assert got["click"]["resumed"]["full"]["candidates"] == int(resumed.sum())
    short = RankingPredictions(scores[1:], scores[1:], y[1:], pred.users[1:])  # a request read short
    with pytest.raises(RuntimeError, match="candidates read"):
        lr._per_user(short, flags)
    for name, over in lr.VARIANTS.items():
        job = load_job(str(lr.ROOT / lr.CONFIG), over)
        assert (job.model.hstu.window, job.model.max_seq_len) == {"full": (0, 8192), "bounded": (512, 8192),
                                                                  "window": (512, 512)}[name]
        assert [t.name for t in job.model.ranking.tasks] == list(lr.TASKS)


@pytest.mark.parametrize("peaks", [[900.5, 1200.0], [1000.0, 1200.0]], ids=["one-process", "two-ranks"])
def test_long_quality_reads_a_runs_peak_memory_from_one_process_or_several(tmp_path, peaks):
    """A run of one process logs its peak memory as a number, a run of several as one per rank:
    ``--nproc 1`` failed with 'float object is not iterable' after training."""
    import json

    from genrec.benchmarks.long_quality import run_stats

    (tmp_path / "results.json").write_text(json.dumps({"epochs": 1, "steps": 3, "train_seconds": 2.0}))
    recs = [{"kind": "train", "samples_per_s": 10.0 + i, "peak_mem_mb": peak if peaks[0] == 900.5 else [peak, 5.0]}
            for i, peak in enumerate(peaks)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert run_stats(tmp_path)["peak_mib_per_rank"] == 1200.0
