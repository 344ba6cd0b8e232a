"""A job's log file (train.observe.logs) and the progress bars of the long commands.

* a training run appends what it says to RUN/train.log (start line, validation, results);
  one that dies writes why, with the traceback, and ``genrec runs list`` shows it failed;
* ``genrec eval --run`` leaves RUN/eval.log; ``train.tensorboard`` mirrors metrics.jsonl;
* the log's rank naming, console rules and appending;
* ``genrec eval --baseline`` shows a progress bar.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from genrec.train.job import load_job
from genrec.train.loop.launch import run_training
from genrec.train.observe.diagnose import NonFiniteError
from genrec.train.observe.logs import log, log_file, run_log
from genrec.train.runs.browse import last_failure, summary
from tests.conftest import tiny_job_overrides


def test_a_library_warning_goes_to_the_file_even_with_a_root_handler(tmp_path):
    """Importing fbgemm_gpu gives the root logger a stderr handler; a warning raised inside
    run_log (DCP's 'torch.distributed is disabled ...') must not reach it."""
    root, console = logging.getLogger(), io.StringIO()
    handler = logging.StreamHandler(console)
    root.addHandler(handler)
    try:
        with run_log(tmp_path) as path, warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("torch.distributed is disabled (a test)", UserWarning, stacklevel=1)
    finally:
        root.removeHandler(handler)
    assert console.getvalue() == ""
    assert "UserWarning: torch.distributed is disabled (a test)" in path.read_text()


def test_genrec_own_warning_reaches_the_console_and_the_file(tmp_path, capsys):
    """A warning genrec itself issues is addressed to the user (e.g. a managed-collision
    checkpoint evaluated on fewer ranks than trained it): stderr and the file, while a
    library's goes to the file alone."""
    import genrec.train.loop.checkpoint as ours

    with run_log(tmp_path) as path, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("tables were trained on 2 ranks (a test)", UserWarning, ours.__file__, 1)
        warnings.warn_explicit("a library speaks (a test)", UserWarning, warnings.__file__, 1)
    err = capsys.readouterr().err
    assert "trained on 2 ranks (a test)" in err and "a library speaks" not in err
    assert "trained on 2 ranks (a test)" in path.read_text() and "a library speaks" in path.read_text()


def test_run_log_appends_per_rank_and_prints_rank_0_and_diagnoses(tmp_path, capsys):
    with run_log(tmp_path, rank=0) as path:
        log.info("first")
        log.info("only in the file", extra={"file_only": True})
    with run_log(tmp_path, rank=0):
        log.info("second")  # a resumed job appends
    with run_log(tmp_path, rank=1) as other:
        log.info("rank 1 says")
        log.warning("diagnosis: rank 1 is behind", extra={"all_ranks": True})
    assert path == tmp_path / "train.log" and other == log_file(tmp_path, 1) == tmp_path / "train.rank1.log"
    lines = path.read_text().splitlines()
    assert [x.split(": ", 1)[1] for x in lines] == ["first", "only in the file", "second"]
    assert all(" rank0 INFO genrec.train: " in x for x in lines)
    assert "rank1 WARNING genrec.train: diagnosis: rank 1 is behind" in other.read_text()
    out = capsys.readouterr().out.splitlines()
    assert out == ["first", "second", "diagnosis: rank 1 is behind"]  # rank 1's plain lines stay in its file
    open_files = [h for h in log.handlers if str(getattr(h, "baseFilename", "")).startswith(str(tmp_path))]
    assert not open_files  # closed with the block


def test_an_exception_leaving_the_log_is_written_with_its_traceback(tmp_path):
    with pytest.raises(ValueError, match="bad shape"), run_log(tmp_path):
        raise ValueError("bad shape")
    text = (tmp_path / "train.log").read_text()
    assert "ERROR genrec.train: job failed: ValueError: bad shape" in text and "Traceback" in text
    assert last_failure(tmp_path / "train.log") == "ValueError: bad shape"
    with run_log(tmp_path):  # a newer attempt that has not failed
        log.info(f"run {tmp_path}: commit abc")
    assert last_failure(tmp_path / "train.log") is None


def test_a_training_run_logs_to_its_directory_and_a_failed_one_says_why(tiny_synth, tiny_config, tmp_path,
                                                                         monkeypatch, capfd):
    from genrec.cli import main

    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--train.max_epochs=1", "--data.valid_users=0.2"]
    run_dir, results = run_training(load_job(tiny_config, base + ["--run.name=ok", "--train.tensorboard=true"]))
    text = (run_dir / "train.log").read_text()
    assert f"rank0 INFO genrec.train: run {run_dir}: commit " in text
    assert "INFO genrec.train: epoch   1 step" in text and "| valid hr@10 " in text
    assert "INFO genrec.train: results: {" in text and '"stopped": "max_epochs"' in text
    # genrec eval --run: what was evaluated and the figures, in RUN/eval.log
    capfd.readouterr()
    assert main(["eval", "--run", str(run_dir), "--json"]) == 0
    evaluated = (run_dir / "eval.log").read_text()
    assert f"eval {run_dir}: checkpoint best, split test" in evaluated and '"ndcg@10": ' in evaluated

    # train.tensorboard: metrics.jsonl's records as scalars, at their steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    loss = board.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in train]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert {"train/time_ms/forward", "train/mfu", "valid/ndcg@10", "test/ndcg@10"} <= set(board.Tags()["scalars"])

    monkeypatch.setenv("GENREC_FAULTS", "nan=tower.layers.0:3")
    with pytest.raises(NonFiniteError):
        run_training(load_job(tiny_config, base + ["--run.name=bad", "--run.id=bad", "--train.log_every_steps=1"]))
    bad = tmp_path / "bad" / "bad"
    text = (bad / "train.log").read_text()
    assert ("WARNING genrec.train: diagnosis: non-finite loss (retrieval, loss) at step 3 (rank 0): "
            "first non-finite output: tower.layers.0 (HSTULayer)") in text
    assert "ERROR genrec.train: job failed: NonFiniteError: non-finite loss" in text and "Traceback" in text
    assert summary(bad)["status"].startswith("failed: NonFiniteError: non-finite loss")


def test_eval_of_a_baseline_shows_a_progress_bar(tiny_synth):
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    proc = subprocess.run([sys.executable, "-m", "genrec.cli", "eval", "--baseline", "popular", "--data",
                           str(tiny_synth), "--json"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert "popular baseline:   0%|" in proc.stderr and "0/2 [" in proc.stderr
