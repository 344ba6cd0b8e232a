"""A job stopped mid-epoch and resumed from its checkpoint follows the same loss trajectory."""

import json

import pytest

from tests.conftest import tiny_job_overrides
from train.job import load_job
from train.run import run_training


def losses(run_dir):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


@pytest.mark.parametrize("tower", ["hstu", "transformer"])
def test_resume_reproduces_the_uninterrupted_loss_trajectory(tiny_synth, tiny_config, tmp_path, tower):
    base = tiny_job_overrides(tiny_synth, tmp_path) + [
        f"--model.tower={tower}", "--train.max_epochs=2", "--train.log_every_steps=1",
        "--data.train_window=random", "--model.transformer.num_heads=2",
    ]
    straight_dir, straight = run_training(load_job(tiny_config, base + ["--run.name=straight"]))
    # Stop after 5 steps (mid-epoch: an epoch here is 10 steps) with a checkpoint there ...
    part_dir, _ = run_training(load_job(tiny_config, base + ["--run.name=parts", "--train.max_steps=5",
                                                             "--train.checkpoint_every_steps=5"]))
    # ... then resume the same run directory without the step limit.
    _, resumed = run_training(load_job(part_dir / "config.toml", ["--train.max_steps=0"]), part_dir)
    a, b = losses(straight_dir), losses(part_dir)
    assert len(a) == 20 and sorted(b) == sorted(a)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    assert resumed["test"]["ndcg@10"] == pytest.approx(straight["test"]["ndcg@10"], abs=1e-6)


def test_without_a_validation_split_the_last_model_is_tested(tiny_synth, tiny_config, tmp_path):
    job = load_job(tiny_config, tiny_job_overrides(tiny_synth, tmp_path) + [
        "--data.valid_users=0", "--train.max_epochs=2", "--run.name=novalid"])
    run_dir, res = run_training(job)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in recs if r.get("split") == "valid"]
    (test,) = [r for r in recs if r.get("split") == "test"]
    assert res["valid"] is None and res["best_step"] == res["steps"] == test["step"] > 0
    assert res["epochs"] == 2 and 0 <= res["test"]["hr@10"] <= 1


def test_budget_horizon_counts_the_epochs_that_fit_the_rest_of_the_budget():
    from train.trainer import budget_horizon

    # 2 epochs done in 70 s of a 600 s budget, 30 s an epoch: (530 * 0.97) // 30 = 17 more
    assert budget_horizon(2, 70.0, 30.0, 600.0, 80) == 19
    assert budget_horizon(2, 70.0, 30.0, 600.0, 10) == 10  # never beyond max_epochs
    assert budget_horizon(2, 590.0, 30.0, 600.0, 80) == 2  # nothing more fits: stop where it is
    assert budget_horizon(2, 700.0, 30.0, 600.0, 80) == 2


def test_a_schedule_fitted_to_the_time_budget_anneals_and_stops_at_its_horizon(tiny_synth, tiny_config, tmp_path,
                                                                             monkeypatch):
    import train.trainer as trainer

    seen = {}

    def fits(epoch, train_seconds, epoch_seconds, budget_s, max_epochs):
        seen.update(epoch=epoch, epoch_seconds=epoch_seconds, budget_s=budget_s, max_epochs=max_epochs)
        return 3  # as if only three epochs fit

    monkeypatch.setattr(trainer, "budget_horizon", fits)
    job = load_job(tiny_config, tiny_job_overrides(tiny_synth, tmp_path) + [
        "--train.max_epochs=6", "--train.time_budget_min=60", "--train.schedule_horizon=time_budget",
        "--train.optim.schedule=cosine", "--train.optim.min_lr_ratio=0.1", "--train.log_every_steps=1",
        "--run.name=fitted"])
    run_dir, res = run_training(job)
    assert seen["epoch"] == 2 and seen["epoch_seconds"] > 0 and seen["budget_s"] == 3600 and seen["max_epochs"] == 6
    assert res["epochs"] == res["schedule_epochs"] == 3 and res["stopped"] == "schedule horizon (time budget)"
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (sched,) = [r for r in recs if r["kind"] == "schedule"]
    assert sched["horizon_epochs"] == 3 and sched["epoch"] == 2
    lrs = {r["step"]: r["lr"] for r in recs if r["kind"] == "train"}
    spe = res["steps"] // 3
    opt = job.train.optim
    # before the fit the schedule ran over 6 epochs, after it over 3: its last step reaches the floor
    for step in (spe, 2 * spe, res["steps"]):
        total = spe * (6 if step <= 2 * spe else 3)
        assert lrs[step] == pytest.approx(opt.lr * trainer.lr_factor(step - 1, total, opt), rel=1e-6), step
    assert lrs[res["steps"]] == pytest.approx(opt.lr * 0.1, rel=0.05)


def test_a_time_budget_schedule_without_a_budget_is_refused(tiny_config):
    with pytest.raises(ValueError, match="time_budget_min"):
        load_job(tiny_config, ["--train.schedule_horizon=time_budget"])
