"""A recipe chosen on validation is tested once: a run trained with ``--eval.test=false`` never
reads the test split, and the quality benchmark records that very run later (``--run``)."""

import json

import pytest

from genrec.benchmarks import quality
from genrec.train.cli import evaluate_run
from genrec.train.job import load_job
from genrec.train.loop.launch import run_training
from tests.conftest import TINY_TABLES, tiny_job_overrides


@pytest.fixture()
def shipped(tmp_path, monkeypatch):
    """A 'shipped' config: the tiny job written out as one file, as configs/hstu.toml is."""
    body = TINY_TABLES + """
[data]
batch_size = 32
eval_batch_size = 64
[model]
max_seq_len = 32
[model.hstu]
num_layers = 1
qk_dim = 16
v_dim = 16
[model.retrieval]
num_negatives = 32
[train]
max_epochs = 1
progress = false
log_every_steps = 2
"""
    path = tmp_path / "shipped.toml"
    path.write_text(body)
    monkeypatch.setitem(quality.CONFIGS, "hstu", str(path))
    return path


def train(config, data, out, *extra):
    job = load_job(config, [*tiny_job_overrides(data, out), "--model.hstu.num_layers=1", "--train.max_epochs=1",
                            "--eval.test=false", *extra])
    return run_training(job)


def test_a_run_without_test_reads_no_test_split_and_is_recorded_once(tmp_path, tiny_synth, shipped):
    run_dir, res = train(shipped, tiny_synth, tmp_path / "runs")
    assert "test" not in res
    splits = {json.loads(line).get("split") for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert "valid" in splits and "test" not in splits
    rec = quality.record_run("tiny", tiny_synth, "hstu", run_dir)
    want, path = evaluate_run(run_dir, None, "test")
    assert path.name == res["best_checkpoint"]
    assert rec["ndcg@10"] == pytest.approx(want["ndcg@10"]) and rec["hr@10"] == pytest.approx(want["hr@10"])
    assert rec["processes"] == 1 and rec["epochs"] == 1


def test_a_run_of_another_config_is_not_recorded_for_the_shipped_one(tmp_path, tiny_synth, shipped):
    run_dir, _ = train(shipped, tiny_synth, tmp_path / "runs", "--model.hstu.dropout=0.3")
    with pytest.raises(SystemExit, match="model.hstu.dropout differ"):
        quality.record_run("tiny", tiny_synth, "hstu", run_dir)
    run_dir, _ = train(shipped, tiny_synth, tmp_path / "runs2", "--eval.test=true")
    with pytest.raises(SystemExit, match="already read the test split"):
        quality.record_run("tiny", tiny_synth, "hstu", run_dir)
