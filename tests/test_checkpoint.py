"""A job stopped mid-epoch and resumed from its checkpoint follows the same trajectory."""

import json
import os
from pathlib import Path

import pytest
import torch

from genrec.train.cli import evaluate_run
from genrec.train.job import load_job
from genrec.train.loop import checkpoint as ckpt
from genrec.train.loop.checkpoint import latest_checkpoint
from genrec.train.loop.launch import run_training
from genrec.train.loop.trainer import Trainer
from tests.conftest import TINY_TABLES, tiny_job_overrides
from tests.dist.trajectory import SCHEDULE, assert_same_trajectory


@pytest.mark.parametrize("tower, ema", [("hstu", 0.0), ("transformer", 0.9)])
def test_resume_reproduces_the_uninterrupted_trajectory(tiny_synth, tmp_path, tower, ema):
    """One process, the tables in AdamW (and a moving average of the weights): stopped after
    4 steps, inside the LR warm-up (the checkpoint's LR is 4/5 of the configured one: a
    schedule based on it ran 20% low), and resumed; per-step LR and loss and the final
    checkpoint (averages included) equal the straight run's."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TABLES + SCHEDULE)
    base = tiny_job_overrides(tiny_synth, tmp_path) + [
        f"--model.tower={tower}", "--train.max_epochs=2", "--train.log_every_steps=1",
        "--data.train_window=random", "--model.transformer.num_heads=2", f"--train.ema_decay={ema}",
    ]
    straight_dir, straight = run_training(load_job(config, base + ["--run.name=straight"]))
    # Stop after 4 steps (mid-epoch: an epoch here is 10 steps) with a checkpoint there ...
    part_dir, _ = run_training(load_job(config, base + ["--run.name=parts", "--train.max_steps=4",
                                                        "--train.checkpoint_every_steps=4"]))
    # ... then resume the same run directory without the step limit.
    _, resumed = run_training(load_job(part_dir / "config.toml", ["--train.max_steps=0"]), part_dir)
    assert straight["steps"] == 20
    assert_same_trajectory(straight_dir, part_dir, evaluated_at_stop=True)
    assert resumed["test"]["ndcg@10"] == pytest.approx(straight["test"]["ndcg@10"], abs=1e-6)


def test_resume_of_a_managed_collision_table_keeps_its_eviction_schedule(tiny_synth, tmp_path):
    """An MCH item table evicting every 3 steps, stopped after 4 (between two evictions) and
    resumed: the ids recorded since the last eviction and the step it happened at travel with
    the checkpoint (TorchRec keeps them outside the state dict), so the resumed run evicts the
    same rows at the same steps as the uninterrupted one and trains the same model."""
    config = tmp_path / "mch.toml"
    config.write_text('[[embedding.tables]]\nname = "item"\nfeatures = ["item"]\ndim = 16\nnum_embeddings = 256\n'
                      'oov = "mch"\nraw_id_space = 1000\nmch_eviction_interval = 3\nmch_buckets = 2\n' + SCHEDULE)
    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--train.max_epochs=1", "--train.log_every_steps=1",
                                                       "--data.valid_users=0", "--eval.test=false"]
    straight, _ = run_training(load_job(config, base + ["--run.name=straight"]))
    parts, _ = run_training(load_job(config, base + ["--run.name=parts", "--train.max_steps=4",
                                                     "--train.checkpoint_every_steps=4"]))
    assert (ckpt.latest_checkpoint(parts / "checkpoints") / ckpt.rank_tensors_file(0)).exists()
    run_training(load_job(parts / "config.toml", ["--train.max_steps=0"]), parts)
    assert_same_trajectory(straight, parts)


def test_without_a_validation_split_the_last_model_is_tested(tiny_synth, tiny_config, tmp_path):
    job = load_job(tiny_config, tiny_job_overrides(tiny_synth, tmp_path) + [
        "--data.valid_users=0", "--train.max_epochs=2", "--run.name=novalid"])
    run_dir, res = run_training(job)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in recs if r.get("split") == "valid"]
    (test,) = [r for r in recs if r.get("split") == "test"]
    assert res["valid"] is None and res["best_step"] == res["steps"] == test["step"] > 0
    assert res["epochs"] == 2
    # the figures reported are the newest checkpoint's, evaluated again from disk
    last = latest_checkpoint(run_dir / "checkpoints")
    assert res["best_checkpoint"] == last.name
    again, _ = evaluate_run(run_dir, str(last), "test")
    assert again == pytest.approx({k: res["test"][k] for k in again}, abs=1e-9) and again["ndcg@10"] > 0


def scripted_selection(tiny_synth, tiny_config, tmp_path, monkeypatch, curve, overrides, extra=None):
    """Trains with validation replaced by ``curve`` (NDCG@10 per epoch, plus ``extra`` keys);
    returns the results, each validation epoch's step and the test record."""
    real = Trainer.evaluate

    def scripted(self, readers):
        if "valid" not in readers:
            return real(self, readers)
        v = curve[self.state.epoch - 1]
        return {"hr@10": 2 * v, "ndcg@10": v, **(extra or {})}

    monkeypatch.setattr(Trainer, "evaluate", scripted)
    job = load_job(tiny_config, tiny_job_overrides(tiny_synth, tmp_path) + [
        f"--train.max_epochs={len(curve)}", *overrides, "--run.name=scripted"])
    run_dir, res = run_training(job)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (test,) = [r for r in recs if r.get("split") == "test"]
    return res, {r["epoch"]: r["step"] for r in recs if r.get("split") == "valid"}, test


@pytest.mark.parametrize("window, best_epoch, epochs", [(1, 2, 4), (3, 6, 8)])
def test_the_checkpoint_is_chosen_on_a_trailing_window_of_evaluations(
        tiny_synth, tiny_config, tmp_path, monkeypatch, window, best_epoch, epochs):
    # validation NDCG@10 per epoch: a spike at epoch 2, then a higher stretch around epoch 6
    curve = [0.10, 0.30, 0.12, 0.20, 0.21, 0.22, 0.15, 0.14, 0.13, 0.12]
    res, valid, test = scripted_selection(tiny_synth, tiny_config, tmp_path, monkeypatch, curve,
                                          ["--train.patience=2", f"--train.select_window={window}"])
    # window 1: the spike is chosen and patience stops two evaluations later; window 3: the
    # best trailing mean (0.20, 0.21, 0.22) ends at epoch 6, two evaluations without a better
    # mean follow, and epoch 6's checkpoint is the one tested
    assert res["epochs"] == epochs == max(valid)
    assert res["best_epoch"] == best_epoch and res["best_step"] == valid[best_epoch] == test["step"]
    assert res["valid"]["ndcg@10"] == curve[best_epoch - 1]
    if window > 1:
        assert res["valid_peak"]["ndcg@10"] == pytest.approx(0.21) and res["valid_peak"]["epoch"] == 6


@pytest.mark.parametrize("within_se, chosen, epochs", [(0.0, 7, 11), (1.0, 8, 12)])
def test_the_newest_checkpoint_within_one_standard_error_of_the_best_is_chosen(
        tiny_synth, tiny_config, tmp_path, monkeypatch, within_se, chosen, epochs):
    # validation NDCG@10 per epoch, each read +-0.02: the peak is epoch 7 (0.26); within one
    # standard error of the best so far are epochs 4-5 (of 3's 0.25) and 8 (of 7's 0.26)
    curve = [0.10, 0.20, 0.25, 0.24, 0.235, 0.21, 0.26, 0.25, 0.20, 0.19, 0.18, 0.17, 0.16, 0.15]
    res, valid, test = scripted_selection(tiny_synth, tiny_config, tmp_path, monkeypatch, curve,
                                          ["--train.patience=4", f"--train.select_within_se={within_se}"],
                                          {"ndcg@10_se": 0.02})
    # strict: epoch 7, and patience stops four evaluations later (11); within one se: epoch 8
    # is chosen, and patience counts the evaluations below 0.24 after it (9-12)
    assert res["epochs"] == epochs == max(valid)
    assert res["best_epoch"] == chosen and res["best_step"] == valid[chosen] == test["step"]
    if within_se:
        assert res["valid_peak"] == {"epoch": 7, "ndcg@10": 0.26, "ndcg@10_se": 0.02}


def test_a_checkpoint_is_fsynced_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    """A power loss after the rename must not publish a checkpoint whose bytes were still in
    the page cache: every file and the folder are fsynced before the rename, the parent after."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self: Path, target):  # noqa: ANN001, ANN202
        events.append(("rename", str(self)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    root = tmp_path / "checkpoints"
    final = ckpt.save_checkpoint(root, 3, {"model": {"w": torch.arange(6.0)}}, {"trainer": {"step": 3}})
    tmp = str(root / f".{final.name}.tmp")
    (at,) = [i for i, (kind, p) in enumerate(events) if kind == "rename" and p == tmp]
    before = {p for kind, p in events[:at] if kind == "fsync"}
    files = {str(p).replace(str(final), tmp) for p in final.rglob("*")}
    assert files and files | {tmp} <= before, sorted(files - before)
    assert ("fsync", str(root)) in events[at + 1:]


def test_a_run_killed_after_it_stopped_stops_again_when_restarted(tiny_synth, tiny_config, tmp_path, monkeypatch):
    """Patience stops the run after epoch 3 and its worker dies in the test that follows; the
    restart (the same command, the same run directory) resumes from the checkpoint written as
    it stopped and must stop there too, not train on. Likewise a spent time budget."""
    curve = [0.30, 0.20, 0.10, 0.40, 0.50, 0.60]  # best at epoch 1: patience 2 stops after epoch 3
    real = Trainer.evaluate

    def scripted(self, readers):
        return real(self, readers) if "valid" not in readers else {"hr@10": 0.1, "ndcg@10": curve[self.state.epoch - 1]}

    monkeypatch.setattr(Trainer, "evaluate", scripted)
    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--train.max_epochs=6", "--train.patience=2", "--run.name=k"]
    finish = Trainer.finish

    def killed(self):
        raise SystemExit("worker killed in its test")

    for stop, extra in (("no improvement in 2 evaluations", []),
                        ("time budget", ["--train.time_budget_min=0.0001", "--train.evaluate=false"])):
        job = load_job(tiny_config, base + extra + [f'--run.id="r{len(extra)}"'])
        monkeypatch.setattr(Trainer, "finish", killed)
        monkeypatch.setattr(Trainer, "summary", killed)  # (the end of a run without evaluation)
        with pytest.raises(SystemExit):
            run_training(job)
        first = ckpt.load_trainer_state(latest_checkpoint(tmp_path / "k" / f"r{len(extra)}" / "checkpoints"))
        monkeypatch.setattr(Trainer, "finish", finish)
        monkeypatch.undo()  # (evaluate too: restored below)
        monkeypatch.setattr(Trainer, "evaluate", scripted)
        _, res = run_training(job)
        assert res["stopped"] == stop and res["steps"] == first["trainer"]["step"], (stop, res["steps"])


def test_pruning_keeps_the_best_that_a_kept_checkpoint_names(tiny_synth, tiny_config, tmp_path, monkeypatch):
    """Two checkpoints kept: step 10 is the best until step 20 takes over, and step 15 still names
    step 10. With step 20 damaged, the resume falls back to step 15, and its run must find the
    checkpoint it would test (step 10), not a pruned directory."""
    real = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate", lambda self, r: real(self, r) if "valid" not in r else {
        "hr@10": 0.1, "ndcg@10": {10: 0.3, 20: 0.5}.get(self.state.step, 0.1)})
    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--run.name=pruned", "--eval.test=false", "--train.max_epochs=2",
                                                       "--train.checkpoint_every_steps=5", "--train.keep_checkpoints=2"]
    run_dir, _ = run_training(load_job(tiny_config, base))
    root = run_dir / "checkpoints"
    assert {p.name for p in ckpt.complete_checkpoints(root)} == {"step_00000010", "step_00000015", "step_00000020"}
    shard = max((root / "step_00000020").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    _, res = run_training(load_job(run_dir / "config.toml", ["--train.max_steps=18"]), run_dir)
    assert res["steps"] == 18 and res["best_step"] == 10


def test_a_run_id_of_another_config_is_refused_and_a_longer_schedule_extends_it(tiny_synth, tiny_config, tmp_path):
    """A job under an existing run.id resumes that run: with another learning rate it would
    train a model its config.toml does not describe, so it is refused naming the key; more steps
    (a restart told to go further) extend it."""
    from genrec.config import ConfigError

    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--run.name=same", '--run.id="r"', "--train.max_epochs=1",
                                                       "--eval.test=false", "--train.checkpoint_every_steps=4"]
    run_dir, _ = run_training(load_job(tiny_config, base + ["--train.max_steps=4"]))
    with pytest.raises(ConfigError, match=r"train.optim.lr: 0.001 there, 0.05 now"):
        run_training(load_job(tiny_config, base + ["--train.max_steps=4", "--train.optim.lr=0.05"]))
    again, res = run_training(load_job(tiny_config, base + ["--train.max_steps=6"]))
    assert again == run_dir and res["steps"] == 6


def test_resume_falls_back_from_a_damaged_newest_checkpoint_and_says_so(tiny_synth, tiny_config, tmp_path):
    """The newest checkpoint truncated (a crash mid-write that the rename did not cover, a full
    disk): --resume takes the one before it, the log names the damaged one and why, and it
    is set aside, not counted as a checkpoint again."""
    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--run.name=damaged", "--train.max_epochs=1",
                                                       "--train.checkpoint_every_steps=2", "--train.keep_checkpoints=3"]
    run_dir, _ = run_training(load_job(tiny_config, base + ["--train.max_steps=4"]))
    root = run_dir / "checkpoints"
    newest = latest_checkpoint(root)
    assert newest is not None and newest.name == "step_00000004"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    _, res = run_training(load_job(run_dir / "config.toml", ["--train.max_steps=6"]), run_dir)
    assert res["steps"] == 6
    recs = [json.loads(line) for line in (run_dir / "diagnosis.jsonl").read_text().splitlines()]
    (bad,) = [r for r in recs if r["kind"] == "damaged_checkpoint"]
    assert bad["checkpoint"] == str(newest) and bad["why"] and bad["used"].endswith("step_00000002")
    (resumed,) = [r for r in recs if r["kind"] == "resumed"]
    assert resumed["checkpoint"].endswith("step_00000002") and resumed["step"] == 2
    log = (run_dir / "train.log").read_text()
    assert f"checkpoint {newest} is damaged" in log and "step_00000002" in log
    assert (root / "damaged_step_00000004").is_dir()


def test_a_cosine_schedule_is_fitted_to_the_time_budget_and_kept_by_a_resume(tiny_synth, tiny_config, tmp_path,
                                                                          monkeypatch):
    """Each epoch is charged 20 s for the first two and 40 s after (a machine that slows down):
    a 150 s budget holds 5 epochs of max_epochs 10. The schedule, fitted after each epoch to the pace so far, spans 7 epochs after the first and 5 after the third, so the
    run's last step trains at the cosine's floor and the run stops after epoch 5 (the budget
    would otherwise cut the schedule off part-way down there, as a fit made once from the first
    epochs' pace would). A worker killed after epoch 3 resumes with the same schedule: the same
    learning rate at every step."""
    real_epoch, real_set_lr = Trainer.run_epoch, Trainer.set_lr

    def slow_epoch(self):  # (the epoch's own seconds replaced, so that both runs read the same clock)
        before = self.state.train_seconds
        charge = 20.0 if self.state.epoch < 2 else 40.0
        real_epoch(self)
        self.state.train_seconds = before + charge

    def dies(self):
        if self.state.epoch == 3:
            raise SystemExit("worker killed")
        slow_epoch(self)

    def patch(run_epoch):
        monkeypatch.setattr(Trainer, "run_epoch", run_epoch)
        monkeypatch.setattr(Trainer, "set_lr", lambda self: (real_set_lr(self), rates.append(
            (self.state.step, self.optimizer.param_groups[0]["lr"]))))

    base = tiny_job_overrides(tiny_synth, tmp_path) + [
        "--train.max_epochs=10", "--train.time_budget_min=2.5", "--train.optim.schedule=cosine",
        "--train.optim.warmup_steps=0", "--train.optim.min_lr_ratio=0.1", "--eval.test=false", "--train.patience=99"]
    rates: list[tuple[int, float]] = []
    patch(slow_epoch)
    run_dir, res = run_training(load_job(tiny_config, base + ["--run.name=fit"]))
    lr = load_job(tiny_config, base).train.optim.lr
    assert res["stopped"] == "time budget" and res["epochs"] == 5, res
    steps = res["steps"]
    assert rates[-1][0] == steps - 1 and rates[-1][1] == pytest.approx(lr * 0.1, rel=0.02), rates[-1]
    assert ckpt.load_trainer_state(latest_checkpoint(run_dir / "checkpoints"))["trainer"]["schedule_epochs"] == 5
    whole = dict(rates)

    rates.clear()
    patch(dies)
    with pytest.raises(SystemExit):
        run_training(load_job(tiny_config, base + ["--run.name=fit2"]))
    monkeypatch.undo()
    patch(slow_epoch)
    run_dir2 = next((tmp_path / "fit2").iterdir())
    _, res2 = run_training(load_job(run_dir2 / "config.toml"), run_dir2)
    assert res2["epochs"] == 5 and res2["steps"] == steps
    resumed = dict(rates)
    differ = [(s, r, whole[s]) for s, r in resumed.items() if r != pytest.approx(whole[s], rel=1e-9)]
    assert resumed and not differ, differ
