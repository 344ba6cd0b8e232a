"""The trainer hands freed heap memory back as it trains (train.loop.trainer.StepMemory), not only
between epochs: a long epoch's RSS must not climb by what glibc keeps of each step's freed tensors."""

from genrec.train.job import load_job
from genrec.train.loop import trainer
from genrec.train.loop.launch import run_training
from tests.conftest import tiny_job_overrides


def test_step_memory_trims_once_rss_has_grown_by_the_slack(monkeypatch):
    rss = iter([1000, 1000 + 2**20, 1000 + (trainer.TRIM_SLACK_MB + 1) * 2**20, 1200, 1300])
    monkeypatch.setattr(trainer, "rss_bytes", lambda: next(rss))
    trims = []
    monkeypatch.setattr(trainer, "release_free_memory", lambda: trims.append(1))
    memory = trainer.StepMemory()  # floor 1000
    assert not memory.after_step()  # 1 MiB more: nothing to return
    assert memory.after_step()  # past the slack: trimmed, and the floor is what is left (1200)
    assert not memory.after_step()  # 1300: within the slack of the new floor
    assert len(trims) == 1


def test_the_trainer_trims_during_an_epoch(tiny_synth, tiny_config, tmp_path, monkeypatch):
    trims = []
    monkeypatch.setattr(trainer, "TRIM_SLACK_MB", -1)  # any growth: a trim after every step
    real = trainer.release_free_memory
    monkeypatch.setattr(trainer, "release_free_memory", lambda: trims.append(1) or real())
    job = load_job(tiny_config, tiny_job_overrides(tiny_synth, tmp_path) + ["--train.max_steps=4",
                                                                            "--train.evaluate=false"])
    run_training(job)
    assert len(trims) >= 4  # (once per epoch before: at most once here)
