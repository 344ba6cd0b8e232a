"""Failure diagnosis (train.observe.diagnose, train.observe.watchdog): each fault injected, its diagnosis
checked for the right names.

* a NaN in one layer's output at step N: the diagnosis names that layer and step, the
  batch and weights are saved, and the replay reproduces the NaN (and, without the fault,
  the loss the uninterrupted run had at that step);
* a rank that sleeps inside a collective (2-process gloo): the watchdog names it as the rank
  behind, and the collective each rank is in, and dumps both ranks' stacks;
* a killed run resumed: it says which checkpoint and step it resumed from;
* loss spikes are flagged.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from genrec.train.job import load_job
from genrec.train.loop.launch import run_training
from genrec.train.observe.diagnose import (
    Diagnoser,
    DiagnosisLog,
    FirstNonFinite,
    NonFiniteError,
    SpikeDetector,
    load_batch,
    save_batch,
)
from genrec.train.observe.watchdog import COLLECTIVES, Watchdog, behind, stall_summary
from tests.conftest import tiny_job_overrides


def diagnoses(run_dir: Path) -> list[dict]:
    path = run_dir / "diagnosis.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# ----- units ---------------------------------------------------------------------------------------
def test_the_first_non_finite_output_and_gradient_are_named():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    net[1].register_forward_hook(lambda m, a, out: out * float("nan"))
    found = FirstNonFinite(net, dict(net.named_parameters()))
    net(torch.randn(3, 4)).sum().backward()
    found.remove()
    assert found.output == {"module": "1", "module_type": "Linear", "inputs_finite": True}
    assert found.grad == "2.weight"  # the NaN reaches the last layer's weight gradient first
    # a finite net: nothing named, and the hooks are gone
    clean = torch.nn.Sequential(torch.nn.Linear(4, 1))
    found = FirstNonFinite(clean, dict(clean.named_parameters()))
    clean(torch.randn(3, 4)).sum().backward()
    found.remove()
    assert found.output is None and found.grad is None and not clean[0]._forward_hooks


def test_a_gradient_that_alone_goes_non_finite_is_named():
    w = torch.nn.Parameter(torch.zeros(3))
    found = FirstNonFinite(torch.nn.Module(), {"w": w})
    torch.sqrt(w).sum().backward()  # finite forward (0), infinite gradient
    found.remove()
    assert found.output is None and found.grad == "w"


def test_a_batch_saved_and_loaded_is_the_same_batch(tiny_synth, tmp_path):
    from genrec.train.data.reader import make_reader
    from genrec.train.data.schema import read_info
    from genrec.train.job import resolve_embedding

    job = load_job(None, tiny_job_overrides(tiny_synth, tmp_path) + ["--data.context_features=true"])
    emb = resolve_embedding(job.embedding, read_info(tiny_synth))
    batch = next(iter(make_reader(job.data, "train", emb, 32)))
    meta = save_batch(batch, tmp_path / "b.safetensors")
    json.dumps(meta)  # what the JSON sidecar holds
    back = load_batch(tmp_path / "b.safetensors", meta)
    assert back.max_len == batch.max_len and back.batch_size == batch.batch_size
    for name in ("seq", "context"):
        a, b = getattr(batch, name), getattr(back, name)
        if a is None:
            assert b is None
            continue
        assert a.keys() == b.keys() and torch.equal(a.values(), b.values()) and torch.equal(a.lengths(), b.lengths())
    for name in ("timestamps", "query_times", "has_time", "targets", "user_ids"):
        a, b = getattr(batch, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b), name


def test_loss_spikes_are_flagged_against_the_running_median(tmp_path):
    det = SpikeDetector(3.0, window=10, warmup=5)
    assert [det.check(x) for x in (5.0, 5.2, 4.9, 5.1, 5.0)] == [None] * 5
    assert det.check(16.0) == 5.0  # 16 > 3 x the median of the 5 before
    assert det.check(6.0) is None
    diag = Diagnoser(tmp_path, 0, 1, None, 2.0, torch.nn.Linear(1, 1))
    for step, loss in enumerate([1.0] * 20 + [2.5], start=1):
        diag.after_step(step, loss)
    (rec,) = diagnoses(tmp_path)
    assert rec["kind"] == "loss_spike" and rec["step"] == 21 and rec["median"] == 1.0
    assert rec["message"].startswith("loss spike at step 21 (rank 0): 2.5 is 2.5x the median 1")


def test_a_restart_says_what_it_resumed_from(tmp_path, monkeypatch):
    diag = Diagnoser(tmp_path, 0, 2, None, 0.0, torch.nn.Linear(1, 1))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    diag.resumed(tmp_path / "checkpoints" / "step_00000004", 4, 0, 1)
    diag.resumed(None, 0, 0, None)
    a, b = diagnoses(tmp_path)
    assert a["message"] == (f"resumed (torchrun restart 1) from {tmp_path}/checkpoints/step_00000004: step 4, "
                            "epoch 0, written by 1 ranks, resumed on 2")
    assert b["message"].startswith("restart 1 found no checkpoint") and b["step"] == 0


def test_the_rank_behind_is_the_one_that_has_not_launched_or_entered_the_collective():
    now = time.time()
    bucket = {"name": "all_reduce (DDP bucket 0)", "since": now - 5, "seq": 7}
    waiting = {"rank": 0, "entered": 7, "open": [{**bucket, "launched": True}]}
    asleep = {"rank": 1, "entered": 7, "open": [{**bucket, "launched": False}]}
    assert behind([waiting, asleep]) == [1]
    line = stall_summary([waiting, asleep], 6, 5.2, 3.0, now)
    assert line == ("step 6 has run 5.2 s (limit 3.0 s): rank 1 is behind; rank 0 in all_reduce (DDP bucket 0) "
                    "for 5.0 s (waiting); rank 1 in all_reduce (DDP bucket 0) for 5.0 s (not launched)")
    outside = {"rank": 1, "entered": 6, "open": [], "top": "trainer.py:250 train_step"}
    assert behind([waiting, outside]) == [1]
    assert "rank 1 in no collective (at trainer.py:250 train_step)" in stall_summary([waiting, outside], 6, 5, 3, now)
    assert behind([waiting, {**waiting, "rank": 1}]) == []


def test_the_watchdog_dumps_the_stacks_of_a_step_far_longer_than_the_median(tmp_path):
    log = DiagnosisLog(tmp_path, 0)
    dog = Watchdog(tmp_path / "diagnosis", 0, 1, min_s=0.3, report=log.write, poll_s=0.05)
    with dog.running():
        for step in range(1, 4):
            dog.step_begins(step)
            dog.step_ends()
        dog.step_begins(4)
        with COLLECTIVES.call("barrier"):
            time.sleep(1.5)
        dog.step_ends()
    kinds = [d["kind"] for d in diagnoses(tmp_path)]
    assert kinds == ["stall_rank", "stall", "stall_end"]
    stall = diagnoses(tmp_path)[1]
    assert stall["step"] == 4 and "rank 0 in barrier for" in stall["message"]
    stacks = (tmp_path / "diagnosis" / "stacks_rank0.txt").read_text()
    assert "--- step 4" in stacks and "test_the_watchdog_dumps_the_stacks" in stacks


# ----- injected faults in real runs ----------------------------------------------------------------
def _losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def test_a_nan_in_one_layer_is_named_and_its_batch_replays(tiny_synth, tiny_config, tmp_path, monkeypatch, capsys):
    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--train.log_every_steps=1", "--train.evaluate=false"]
    monkeypatch.setenv("GENREC_FAULTS", "nan=tower.layers.1:5")
    with pytest.raises(NonFiniteError, match=r"step 5 \(rank 0\): first non-finite output: tower.layers.1 \(HSTULayer\), "
                                             "from finite inputs"):
        run_training(load_job(tiny_config, base + ["--run.name=bad", "--run.id=bad"]))
    run_dir = tmp_path / "bad" / "bad"
    (rec,) = diagnoses(run_dir)
    assert (rec["kind"], rec["step"], rec["module"], rec["inputs_finite"]) == ("nonfinite", 5, "tower.layers.1", True)
    assert rec["losses"]["loss"] == "nan" and rec["parameter"] is not None
    assert f"diagnosis: {rec['message']}" in capsys.readouterr().out
    assert sorted(_losses(run_dir)) == [1, 2, 3, 4]  # the bad step updated nothing and logged nothing
    replay = Path(rec["replay"])
    assert replay.name == "nonfinite_step5_rank0.json" and (replay.parent / "step_00000005" / ".metadata").exists()
    # the replay, with the fault still there, stops with the same diagnosis
    again = [f"--train.replay={replay}"]
    with pytest.raises(NonFiniteError, match=r"step 5 \(rank 0\): first non-finite output: tower.layers.1 "):
        run_training(load_job(run_dir / "config.toml", again), run_dir)
    # without it, the saved weights, batch and RNG give the loss an unbroken run had at step 5
    monkeypatch.delenv("GENREC_FAULTS")
    _, res = run_training(load_job(run_dir / "config.toml", again), run_dir)
    clean_dir, _ = run_training(load_job(tiny_config, base + ["--run.name=clean", "--train.max_steps=5"]))
    assert res["stopped"] == "replay" and res["replay"]["step"] == 5
    assert res["replay"]["losses"]["loss"] == pytest.approx(_losses(clean_dir)[5], rel=1e-6)
    assert [d["kind"] for d in diagnoses(run_dir)] == ["nonfinite", "nonfinite", "replay"]


def test_a_killed_run_says_what_it_resumed_from(tiny_synth, tiny_config, tmp_path):
    from tests.test_distributed import ENV, run

    args = [sys.executable, "-m", "genrec.cli", "train", "--config", str(tiny_config),
            *tiny_job_overrides(tiny_synth, tmp_path), "--train.checkpoint_every_steps=4", "--run.id=k"]
    proc = run(args, env={**ENV, "GENREC_FAULTS": "kill=0:6"}, check=False)
    assert proc.returncode == -9
    run_dir = tmp_path / "tiny" / "k"
    again = run([sys.executable, "-m", "genrec.cli", "train", "--resume", str(run_dir), "--train.max_steps=7"])
    (rec,) = diagnoses(run_dir)
    assert rec["kind"] == "resumed" and rec["step"] == 4 and rec["checkpoint"] == str(run_dir / "checkpoints" / "step_00000004")
    assert f"diagnosis: resumed from {run_dir}/checkpoints/step_00000004: step 4, epoch 0" in again.stdout


def test_a_rank_asleep_in_a_collective_is_named_by_the_watchdog(tiny_synth, tmp_path):
    """2 processes (DDP): rank 1 sleeps 12 s inside step 6's first collective (a DDP
    gradient bucket's all-reduce, before launching it); rank 0 launches its own and waits.
    Both watchdogs fire (limit: max(10 x median step, 2 s)); rank 0's line names rank 1 as
    behind and each rank's collective; both ranks' stacks are on disk; the run then ends
    normally."""
    from tests.test_distributed import DDP_CONFIG, ENV, TORCHRUN, free_port, run, train_args

    env = {**ENV, "GENREC_FAULTS": "stall=1:6:12"}
    run(TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port())]
        + train_args(tiny_synth, tmp_path, "stall", ["--train.watchdog_min_s=2", "--train.max_steps=8",
                                                      "--train.evaluate=false"], config=DDP_CONFIG), env=env)
    run_dir = tmp_path / "dist" / "stall"
    recs = diagnoses(run_dir)
    (stall,) = [d for d in recs if d["kind"] == "stall"]
    assert stall["rank"] == 0 and stall["step"] == 6 and stall["behind"] == [1], stall["message"]
    assert "rank 1 is behind" in stall["message"]
    assert "rank 1 in all_reduce (DDP bucket" in stall["message"] and "(not launched)" in stall["message"]
    assert "rank 0 in all_reduce (DDP bucket" in stall["message"] and "(waiting)" in stall["message"]
    assert {d["rank"] for d in recs if d["kind"] == "stall_rank"} == {0, 1}
    assert "_maybe_stall" in (run_dir / "diagnosis" / "stacks_rank1.txt").read_text()
    assert "train_step" in (run_dir / "diagnosis" / "stacks_rank0.txt").read_text()
    assert any(d["kind"] == "stall_end" and d["step"] == 6 for d in recs)
