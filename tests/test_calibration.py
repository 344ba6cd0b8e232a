"""Calibration of ranking probabilities: PAV, the calibrator module, ECE, checkpoints and
artifacts, and the served probabilities against the offline calibrated ones."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from genrec.models.calibration import Calibrator, fit_isotonic, pav
from genrec.models.dlrm import PooledDLRM
from genrec.models.ranking import RankingConfig
from genrec.quant.dense import dense_tensors, load_dense
from genrec.train.eval.ranking_metrics import ece, ece_floor, reliability
from genrec.train.loop import checkpoint as ckpt
from tests.test_ranking import HACT, HIST, TASKS, emb_cfg, make_batch, model


def brute_force_isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The best non-decreasing fit over every split of y into consecutive blocks (each at
    its weighted mean): the optimum is one of them."""
    best, best_err = None, np.inf
    n = y.size
    for cuts in itertools.product([False, True], repeat=n - 1):
        ends = [i + 1 for i, c in enumerate(cuts) if c] + [n]
        fit, start = np.empty(n), 0
        for end in ends:
            fit[start:end] = np.average(y[start:end], weights=w[start:end])
            start = end
        if np.all(np.diff(fit) >= -1e-12):
            err = float((w * (fit - y) ** 2).sum())
            if err < best_err - 1e-12:
                best, best_err = fit, err
    return best


@pytest.mark.parametrize("seed", range(6))
def test_pav_equals_the_brute_force_isotonic_fit(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 8).astype(float) if seed % 2 else rng.normal(size=8)
    w = rng.uniform(0.5, 3.0, 8)
    values, weights, ends = pav(y, w)
    fit = np.repeat(values, np.diff(np.r_[0, ends]))
    np.testing.assert_allclose(fit, brute_force_isotonic(y, w), atol=1e-12)
    assert np.all(np.diff(values) > 0) and weights.sum() == pytest.approx(w.sum())


def test_knots_are_the_block_centres_and_strictly_increase():
    p, labels = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 1, 0, 1])
    x, y = fit_isotonic(p, labels, prior=0.0, min_block=1)
    np.testing.assert_allclose(x, [0.1, 0.25, 0.4])
    np.testing.assert_allclose(y, [0.0, 0.5, 1.0])
    # the prior keeps every knot inside (0, 1): no block predicts a certainty
    _, y = fit_isotonic(p, labels, min_block=1)
    assert 0 < y[0] < y[1] < y[2] < 1
    # light blocks join their neighbours: two examples do not bend a block of 40 toward them
    p, labels = np.r_[np.linspace(0.4, 0.5, 40), 0.51, 0.52], np.r_[np.arange(40) % 2, 1, 1]
    x, y = fit_isotonic(p, labels, prior=0.0, min_block=10)
    assert x.size == 1 and y[0] == pytest.approx(labels.mean())
    _, y = fit_isotonic(p, labels, prior=0.0, min_block=1)
    assert y[-1] == 1.0  # without pooling, their block of two predicts a certainty


def miscalibrated(n: int = 20000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[n, 2] predictions whose true rates are p^2 (task 0) and sqrt(p) / 2 (task 1)."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.01, 0.99, (n, 2))
    truth = np.stack([p[:, 0] ** 2, np.sqrt(p[:, 1]) / 2], 1)
    return p, (rng.uniform(size=(n, 2)) < truth).astype(np.float64)


def test_calibrator_is_the_identity_until_fitted_then_monotone_and_clipped():
    cal = Calibrator(2)
    p = torch.rand(50, 2)
    assert torch.equal(cal(p), p) and not cal.fitted.any()
    probs, labels = miscalibrated()
    cal.fit(probs, labels)
    assert cal.fitted.all() and int(cal.counts.max()) <= cal.knots_x.shape[1]
    grid = torch.linspace(0, 1, 2001)[:, None].repeat(1, 2)
    out = cal(grid)
    assert torch.all(out.diff(dim=0) >= 0)
    lo = grid[:, 0] >= cal.knots_x[:, 0].max()
    hi = grid[:, 0] <= cal.knots_x[torch.arange(2), cal.counts - 1].min()
    assert torch.all(out[lo & hi].diff(dim=0) > 0)  # strictly between the knots: eCPM keeps its order
    assert torch.equal(out[0], cal.knots_y[:, 0]) and torch.equal(out[-1], cal.knots_y[torch.arange(2), cal.counts - 1])
    # it learned the truth: close to p^2 and sqrt(p) / 2 in the middle
    mid = torch.tensor([[0.5, 0.5]])
    torch.testing.assert_close(cal(mid), torch.tensor([[0.25, 0.5**0.5 / 2]]), atol=0.03, rtol=0)
    cal.reset()
    assert torch.equal(cal(p), p)


def test_calibration_lowers_the_ece_of_held_out_predictions():
    cal = Calibrator(2)
    cal.fit(*miscalibrated(seed=0))
    p, y = miscalibrated(seed=1)
    after = cal(torch.from_numpy(p).float()).numpy()
    for t in range(2):
        assert ece(after[:, t], y[:, t]) < 0.02 < ece(p[:, t], y[:, t])


def test_a_fitted_calibrator_survives_state_dict_and_safetensors(tmp_path):
    full = Calibrator(2)
    full.fit(*miscalibrated())
    cal = Calibrator(2, max_knots=16)  # fewer knots than PAV blocks: neighbours pooled
    cal.fit(*miscalibrated())
    assert full.counts.min() > 16 >= cal.counts.max() and cal.counts.min() > 8
    save_file(cal.state_dict(), tmp_path / "cal.safetensors")
    again = Calibrator(2, max_knots=16)
    again.load_state_dict(load_file(tmp_path / "cal.safetensors"))
    p = torch.rand(100, 2)
    assert torch.equal(again(p), cal(p)) and not torch.equal(again(p), p)
    again.validate()
    again.knots_x[0, 3] = -1.0
    with pytest.raises(ValueError, match="non-decreasing"):
        again.validate()


def test_ece_on_known_cases():
    assert ece(np.full(10, 0.1), np.r_[1, np.zeros(9)]) == pytest.approx(0.0, abs=1e-12)
    assert ece(np.full(10, 0.5), np.r_[1, np.zeros(9)]) == pytest.approx(0.4)
    # 20 distinct predictions: 10 bins of 2, each with one positive (rate 0.5)
    p = np.arange(20) / 20
    mean_p, rate, size = reliability(p, np.arange(20) % 2)
    np.testing.assert_allclose(size, 2) and np.testing.assert_allclose(rate, 0.5)
    assert ece(p, np.arange(20) % 2) == pytest.approx(np.abs(mean_p - 0.5).mean())


def test_the_ece_floor_is_what_calibrated_labels_show_and_shrinks_with_examples():
    rng = np.random.default_rng(3)
    p = rng.beta(2, 5, 20_000)
    floor = ece_floor(p)
    drawn = [ece(p, rng.random(p.size) < p) for _ in range(20)]
    assert abs(floor - np.mean(drawn)) < 3 * np.std(drawn) / np.sqrt(20) + 1e-4
    assert ece_floor(p[:2_000]) > 2 * floor  # ~ 1 / sqrt(N): 10x fewer examples, ~3x the floor
    assert ece(p, rng.random(p.size) < np.clip(p + 0.05, 0, 1)) > 3 * floor  # a shift of 0.05 stands out


def test_every_probability_path_applies_the_calibrator():
    """model.rank, score_candidates and the DLRM baseline's rank give the calibrated
    probabilities; calibrated=False the raw sigmoid; calibration = "none" ignores the map."""
    m = model()
    users = [(HIST, HACT, [11, 12, 13]), ([5, 6], [1, 3], [14, 15])]
    hist_only = make_batch([(h, a, []) for h, a, _ in users])
    hist_only.num_targets = None
    items = torch.tensor([c for _, _, cs in users for c in cs])
    owner = torch.tensor([i for i, (_, _, cs) in enumerate(users) for _ in cs])
    dlrm = PooledDLRM(RankingConfig(tasks=TASKS, dropout=0.0), emb_cfg()).eval()
    with torch.no_grad():
        raw = m.rank(make_batch(users), calibrated=False)
        m.ranking.calibrator.fit(*miscalibrated())
        cal = m.rank(make_batch(users))
        torch.testing.assert_close(cal, m.ranking.calibrator(raw))
        assert not torch.allclose(cal, raw, atol=1e-3)
        _, state = m.encode_history(hist_only)
        torch.testing.assert_close(m.score_candidates(state, items, owner), cal)
        dlrm.ranking.calibrator.fit(*miscalibrated())
        batch = make_batch(users)
        torch.testing.assert_close(dlrm.rank(batch), dlrm.head.calibrator(torch.sigmoid(dlrm.rank_logits(batch))))
        object.__setattr__(m.ranking.cfg, "calibration", "none")  # what a config with "none" builds
        torch.testing.assert_close(m.rank(make_batch(users)), raw)


def test_checkpoints_and_artifacts_without_a_calibrator_load_it_unfitted(tmp_path):
    m = model()
    m.ranking.calibrator.fit(*miscalibrated())
    old = {k: v for k, v in m.state_dict().items() if ".calibrator." not in k}
    dcp.save({"model": old}, checkpoint_id=tmp_path / "old")
    fresh = model()
    ckpt.PlainState(fresh, None).restore(tmp_path / "old", with_optimizer=False)
    assert not fresh.ranking.calibrator.fitted.any()
    # the artifact's dense tensors: kept fp32 under bf16, and optional when loading
    dense = dense_tensors(m, "bf16")
    assert dense["ranking.calibrator.knots_y"].dtype == torch.float32
    torch.testing.assert_close(dense["ranking.calibrator.knots_y"], m.ranking.calibrator.knots_y)
    served = model()
    load_dense(served, {k: v for k, v in dense.items() if ".calibrator." not in k}, "bf16", torch.device("cpu"))
    assert not served.ranking.calibrator.fitted.any()
    load_dense(served, dense, "bf16", torch.device("cpu"))
    assert torch.equal(served.ranking.calibrator.knots_x, m.ranking.calibrator.knots_x)


def test_amend_checkpoint_replaces_the_calibrator_and_keeps_the_rest(tmp_path):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m.train()
    m.rank(make_batch([(HIST, HACT, [11, 12])]), calibrated=False).sum().backward()
    opt.step()
    io = ckpt.PlainState(m, opt)
    path = ckpt.save_checkpoint(tmp_path, 7, io.state(), {"trainer": {"step": 7}})
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.ranking.calibrator.fit(*miscalibrated())
    fitted = {k: v.clone() for k, v in m.named_buffers() if ".calibrator." in k}
    ckpt.amend_checkpoint(io, path, m, fitted)
    assert json.loads((path / "trainer_state.rank0.json").read_text())["trainer"] == {"step": 7}
    other = model()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    ckpt.restore(ckpt.PlainState(other, other_opt), path)
    for k, v in other.state_dict().items():
        torch.testing.assert_close(v, fitted.get(k, before[k]), rtol=0, atol=0)
    assert other_opt.state_dict()["state"]  # the optimizer's moments came back too


# ----- end to end: train -> calibrate -> quantize -> serve ----------------------------------------


@pytest.fixture(scope="module")
def calibrated_run(tiny_synth, tmp_path_factory):
    """A tiny ranking run (one epoch: its finish fits the calibrator) and its fp32 artifact,
    whose served model holds the training weights exactly."""
    from genrec.quant.convert import QuantizeConfig, export
    from genrec.train.job import load_job
    from genrec.train.loop.launch import run_training
    from tests.conftest import tiny_job_overrides
    from tests.serving_helpers import RANKING_TOML

    out = tmp_path_factory.mktemp("calibrated")
    cfg = out / "rank.toml"
    cfg.write_text(RANKING_TOML)
    run_dir, results = run_training(load_job(cfg, tiny_job_overrides(tiny_synth, out / "runs") + ["--train.max_epochs=1"]))
    art = out / "artifact"
    export(run_dir, art, QuantizeConfig(embeddings="fp32", dense="fp32"), progress=False, measure_accuracy=False)
    return run_dir, results, art


def test_training_fits_the_calibrator_into_the_best_checkpoint_and_reports_both(calibrated_run):
    from genrec.quant.convert import load_training_model, resolve_checkpoint
    from genrec.train.cli import evaluate_run

    run_dir, results, _ = calibrated_run
    assert set(results["calibration"]["tasks"]) == {"click", "conversion"}
    test = results["test"]
    for t in ("click", "conversion"):
        for k in ("auc", "gauc", "ne", "ece", "ne_uncalibrated", "ece_uncalibrated"):
            assert np.isfinite(test[f"{t}/{k}"]), f"{t}/{k}"
    assert (run_dir / "reliability_valid.png").stat().st_size and (run_dir / "reliability_test.png").stat().st_size
    _, m = load_training_model(*resolve_checkpoint(run_dir))
    assert m.ranking.calibrator.fitted.all()
    again, _ = evaluate_run(run_dir, None, "test")  # genrec eval: the same calibrated figures from disk
    keys = [k for k in test if "/" in k]
    assert again == pytest.approx({**again, **{k: test[k] for k in keys}}, abs=1e-9)


def test_served_probabilities_are_the_offline_calibrated_ones(calibrated_run):
    """Every engine (the gRPC server's default, the packed path on the PyTorch backend, the
    batch path, the naive engine) serves model.rank's calibrated probabilities, which differ
    from the raw sigmoids: a path that skipped the calibrator fails here."""
    from genrec.benchmarks.naive_engine import NaiveTorchEngine
    from genrec.loadtest.client import RecommenderClient, user
    from genrec.quant.convert import load_training_model, resolve_checkpoint
    from genrec.serve.engine import TorchEngine, collate_users
    from genrec.serve.requests import Limits, Work, decode_user
    from tests.serving_helpers import ThreadedServer

    run_dir, _, art = calibrated_run
    _, offline = load_training_model(*resolve_checkpoint(run_dir))
    rng = np.random.default_rng(0)
    t0 = 1_700_000_000
    requests = []
    for r in range(4):
        hist = [(int(rng.integers(1, 600)), t0 + 60 * i, int(rng.choice([1, 3, 7]))) for i in range(6 + 3 * r)]
        requests.append((user(hist, {"region": [r]}), [(int(c), 1.0) for c in rng.choice(np.arange(1, 600), 8, replace=False)]))
    srv = ThreadedServer(art)
    try:
        client = RecommenderClient(srv.target)
        served = [np.array([[i.tasks["click"], i.tasks["conversion"]] for i in client.rank(u, c, objective="click").items])
                  for u, c in requests]
        schema = srv.server.engine.schema
    finally:
        srv.stop()
    works = [Work("rank", decode_user(u, schema, Limits()), candidates=np.array([x for x, _ in c]),
                  candidate_ids=np.array([x for x, _ in c]), bids=np.ones(len(c)), objective="click")
             for u, c in requests]
    engines = [TorchEngine(art, packed=True, native=False), TorchEngine(art, packed=False), NaiveTorchEngine(art)]
    by_engine = [[np.stack([r.tasks["click"], r.tasks["conversion"]], 1) for r in e.run(works)] for e in engines]
    with torch.no_grad():
        for k, w in enumerate(works):
            batch = collate_users([w.user], offline, torch.device("cpu"), candidates=[w.candidates])
            want, raw = offline.rank(batch).numpy(), offline.rank(batch, calibrated=False).numpy()
            assert np.abs(want - raw).max() > 1e-3  # calibration moves these probabilities
            np.testing.assert_allclose(served[k], want, atol=2e-5, rtol=0)
            for got in by_engine:
                np.testing.assert_allclose(got[k], want, atol=2e-5, rtol=0)
