"""``genrec runs list | show`` read run directories as they are written."""

from __future__ import annotations

import json

from genrec.cli import main as genrec
from genrec.config import dump_toml
from genrec.train.job import JobConfig
from genrec.train.runs.browse import find_runs, summary


def fake_run(root, name, data, results=None, metric="ndcg@10", dirty=False, metrics=True):
    run = root / name
    run.mkdir(parents=True)
    from dataclasses import replace

    job = JobConfig()
    job = replace(job, data=replace(job.data, path=str(data)), train=replace(job.train, early_stop_metric=metric))
    (run / "config.toml").write_text(dump_toml(job))
    (run / "version.json").write_text(json.dumps({"commit": "0123456789abcdef", "dirty": dirty}))
    if metrics:
        (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    if results is not None:
        (run / "results.json").write_text(json.dumps(results))
    return run


def test_runs_list_and_show(tmp_path, capfd):
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset.json").write_text('{"users": 3}')
    root = tmp_path / "runs"
    done = fake_run(root, "hstu/a", data, {"stopped": "max_epochs", "train_seconds": 600.0,
                                           "valid": {"ndcg@10": 0.25, "ndcg@10_se": 0.01, "hr@10": 0.4},
                                           "test": {"ndcg@10": 0.24, "hr@10": 0.39}})
    killed = fake_run(root, "sid/b", data, None, metric="gen_ndcg@10", dirty=True)
    assert find_runs(root) == [done, killed]
    a, b = summary(done, root), summary(killed, root)
    assert (a["run"], a["commit"], a["status"], a["valid"], a["test"], a["minutes"]) == (
        "hstu/a", "01234567", "max_epochs", 0.25, 0.24, 10.0)
    assert (b["commit"], b["status"], b["metric"], b["valid"]) == ("01234567+", "no results (running or killed)",
                                                                  "gen_ndcg@10", None)
    assert a["data"] == b["data"] and a["data"].startswith(str(data))  # the same data, the same fingerprint
    (data / "dataset.json").write_text('{"users": 4}')
    assert summary(done, root)["data"] != a["data"]

    assert genrec(["runs", "list", "--root", str(root)]) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[0].startswith("| run | started | commit | data | status | metric | valid | test | minutes |")
    assert "| hstu/a |" in out[2] and "| 0.2500 | 0.2400 | 10.0 |" in out[2]
    assert "| sid/b |" in out[3] and "no results" in out[3]
    assert genrec(["runs", "show", str(done)]) == 0
    shown = capfd.readouterr().out
    assert "ndcg@10 = 0.2500 +- 0.0100" in shown and "hr@10 = 0.3900" in shown


def test_runs_of_a_missing_root_or_run_exit_2(tmp_path, capfd):
    assert genrec(["runs", "list", "--root", str(tmp_path / "nowhere")]) == 2
    assert genrec(["runs", "show", str(tmp_path)]) == 2
    assert "not a run directory" in capfd.readouterr().err


def test_runs_compare(tmp_path, capfd):
    data = tmp_path / "data"
    data.mkdir()
    root = tmp_path / "runs"
    a = fake_run(root, "a", data, {"stopped": "max_epochs", "train_seconds": 60.0, "valid": {"ndcg@10": 0.2},
                                   "test": {"ndcg@10": 0.19, "hr@10": 0.3}})
    b = fake_run(root, "b", tmp_path / "other", {"stopped": "time budget", "train_seconds": 120.0,
                                                 "valid": {"ndcg@10": 0.3}, "test": {"ndcg@10": 0.28, "hr@10": 0.4}})
    for run, values in ((a, (0.1, 0.2)), (b, (0.2, 0.3))):
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"kind": "eval", "split": "valid", "epoch": e + 1, "ndcg@10": v}) + "\n"
            for e, v in enumerate(values)))
    png = tmp_path / "cmp.png"
    assert genrec(["runs", "compare", str(a), str(b), "--out", str(png)]) == 0
    out = capfd.readouterr().out
    assert "config: 1 keys differ" in out and f"| data.path | {data} | {tmp_path / 'other'} |" in out
    assert f"| {a} | ndcg@10 | 0.2000 | 0.3000 | 0.1900 | 1.0 |" in out
    assert f"| {b} | ndcg@10 | 0.3000 | 0.4000 | 0.2800 | 2.0 |" in out
    assert png.stat().st_size > 0
    assert genrec(["runs", "compare", str(a), str(tmp_path)]) == 2


def test_training_in_process_gives_the_matmul_precision_back(tiny_synth, tmp_path):
    """run_training sets the job's fp32 GEMM precision ("medium" by default) and once left it
    set: on a CPU with AMX every later fp32 GEMM of the process ran in bf16 (the native serving
    parity tests failed after a fixture trained in-process)."""
    import torch

    from genrec.train.job import load_job
    from genrec.train.loop.launch import run_training
    from tests.conftest import tiny_job_overrides

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        job = load_job("configs/hstu.toml", tiny_job_overrides(tiny_synth, tmp_path) + [
            "--train.max_epochs=1", '--train.matmul_precision="medium"'])
        run_training(job)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
