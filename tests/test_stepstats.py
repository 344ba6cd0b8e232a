"""Step-time accounting and profiles (train.observe.stepstats, train.observe.profiling).

The checks are of bookkeeping, never of speed: the recorded parts of a step add up to the
recorded step time, FLOPs are counted as torch counts them, a profile writes its trace and
a summary that names what bounds the step.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from genrec.train.job import load_job
from genrec.train.loop.launch import run_training
from genrec.train.observe.stepstats import PARTS, CommTimes, FlopCount, StepStats, matmul_peak
from tests.conftest import tiny_job_overrides


def parts_add_up(rec: dict, within: float = 0.05) -> None:
    t = rec["time_ms"]
    total = sum(t[k] for k in PARTS)
    assert total == pytest.approx(t["step"], rel=within), (total, t)


def test_the_marked_parts_tile_the_interval():
    """A fake loop of 3 steps, each part some work: the parts recorded add up to the
    interval's wall time as read apart from the marks, and the interval restarts after."""
    stats = StepStats(torch.device("cpu"))
    stats.start()
    x = torch.randn(64, 64)
    for _ in range(3):
        for part in ("data", "optimizer", "forward", "backward", "optimizer", "other"):
            with stats.phase(part):
                for _ in range(5):
                    x = torch.tanh(x @ x)
        stats.count_step()
    rec = stats.take()
    parts_add_up(rec)
    assert all(rec["time_ms"][k] > 0 for k in ("data", "forward", "backward", "optimizer", "other"))
    assert rec["peak_mem_mb"] > 0 and "mfu" not in rec  # no FLOPs counted
    assert stats.take() == {}  # an interval without steps has nothing to say


def test_accounting_off_records_nothing():
    stats = StepStats(torch.device("cpu"), enabled=False)
    with stats.phase("forward"):
        pass
    stats.count_step()
    assert stats.take() == {} and not stats.wants_flops()


def test_the_flop_counting_step_is_left_out_of_the_interval(tmp_path, monkeypatch):
    monkeypatch.setenv("GENREC_CACHE", str(tmp_path))
    stats = StepStats(torch.device("cpu"))
    assert stats.wants_flops()
    with stats.phase("forward"):
        time.sleep(0.01)
    rec = stats.set_flops(10**9)
    assert rec["kind"] == "flops" and rec["peak_tflops"] > 0 and rec["compute_dtype"] == "float32"
    stats.count_step()  # the counted step: the interval starts again here
    stats.mark("forward")
    stats.count_step()
    out = stats.take()
    assert out["time_ms"]["forward"] < 10  # the 10 ms before the restart are not in it
    assert out["mfu"] == pytest.approx(out["tflops"] / rec["peak_tflops"])


def test_flops_are_torch_counts_of_forward_and_backward():
    lin = torch.nn.Linear(32, 16, bias=False)
    x = torch.randn(8, 32, requires_grad=True)
    count = FlopCount()
    lin(x).sum().backward()
    assert count.finish() == 3 * 2 * 8 * 32 * 16  # forward, grad of input, grad of weight


def test_counting_flops_leaves_managed_collision_tables_as_they_were(tiny_synth, tmp_path):
    """The FLOP count's own pass must not move an MCH table (its counters, its remap, the step
    it last evicted at): a resumed run counts again at its first step, so a pass that moved
    them would train a resumed model differently from the uninterrupted one."""
    from contextlib import nullcontext

    from genrec.train.data.reader import make_reader
    from genrec.train.data.schema import read_info
    from genrec.train.job import build_model, resolve_embedding
    from genrec.train.observe.stepstats import count_model_flops

    cfg = tmp_path / "mch.toml"
    cfg.write_text('[[embedding.tables]]\nname = "item"\nfeatures = ["item"]\ndim = 16\nnum_embeddings = 64\n'
                   'oov = "mch"\nraw_id_space = 1000000\nmch_eviction_interval = 2\nmch_buckets = 1\n')
    job = load_job(cfg, tiny_job_overrides(tiny_synth, tmp_path))
    model, emb = build_model(job)
    batch = next(iter(make_reader(job.data, "train", resolve_embedding(job.embedding, read_info(job.data.path)),
                                  job.model.max_seq_len)))
    model.train()
    for _ in range(3):  # (the table in use: ids remapped, an eviction behind it)
        model(batch)["loss"].backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flops, how = count_model_flops(model, batch, nullcontext)
    after = model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert flops > 0 and how == "3 x forward" and model.training


def test_matmul_peak_is_measured_once_per_machine_and_leaves_the_rng_alone(tmp_path):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = matmul_peak(torch.device("cpu"), torch.float32, cache=tmp_path)
    assert torch.equal(torch.get_rng_state(), before)
    again = matmul_peak(torch.device("cpu"), torch.float32, cache=tmp_path)
    assert again == first and first["tflops"] > 0  # read back, not measured again
    assert len(json.loads((tmp_path / "matmul_peak.json").read_text())) == 1


def test_all_reduce_time_is_the_union_of_the_buckets_in_flight():
    comm = CommTimes()
    comm.add_all_reduce(0.0, 2.0)
    comm.add_all_reduce(1.0, 3.0)  # overlaps the first: counted once
    comm.add_all_reduce(5.0, 6.0)
    comm.add_all_to_all(0.5)
    assert comm.take() == {"all_to_all": 0.5, "all_reduce": 4.0}
    assert comm.take() == {"all_to_all": 0.0, "all_reduce": 0.0}


def test_progress_bar_form():
    rec = {"time_ms": {"step": 85.2, "data": 3.1, "forward": 40.2, "backward": 30.3, "optimizer": 8.0,
                       "checkpoint": 0.0, "other": 3.6}, "mfu": 0.0123}
    assert StepStats.postfix(rec) == {"ms": "85=d3+f40+b30+o8+x4", "mfu": "1.2%"}


def test_a_run_logs_the_accounting_and_a_requested_profile(tiny_synth, tiny_config, tmp_path):
    """A tiny run: every train record's parts add up to its step time within 5%; FLOPs,
    MFU and peak memory are there; steps 3-5 were profiled into a trace and a summary."""
    job = load_job(tiny_config, tiny_job_overrides(tiny_synth, tmp_path) + [
        "--train.max_epochs=1", "--train.evaluate=false", "--train.log_every_steps=2",
        "--train.profile_steps=3:6", "--run.name=acct"])
    run_dir, _ = run_training(job)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (flops,) = [r for r in recs if r["kind"] == "flops"]
    assert flops["flops_per_step"] > 0 and flops["peak_tflops"] > 0
    train = [r for r in recs if r["kind"] == "train"]
    assert len(train) >= 4
    for r in train:
        parts_add_up(r)
        assert 0 < r["mfu"] < 1 and r["tflops"] > 0 and r["peak_mem_mb"] > 0
    trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"genrec.forward", "genrec.backward", "genrec.data", "aten::mm"} <= names
    summary = (run_dir / "profile" / "summary_rank0.txt").read_text()
    assert summary.startswith("profile of steps 3-5 on rank 0: 3 steps")
    assert "bound by: " in summary and "aten::mm" in summary and "matmul" in summary


def test_accounting_off_logs_the_same_losses_without_it(tiny_synth, tiny_config, tmp_path):
    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--train.max_steps=4", "--train.evaluate=false",
                                                       "--train.log_every_steps=1"]
    on, _ = run_training(load_job(tiny_config, base + ["--run.name=on"]))
    off, _ = run_training(load_job(tiny_config, base + ["--run.name=off", "--train.step_stats=false"]))
    a, b = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (on, off))
    assert [r["loss"] for r in a if r["kind"] == "train"] == [r["loss"] for r in b if r["kind"] == "train"]
    assert all("time_ms" not in r and "mfu" not in r for r in b)
    assert any("time_ms" in r for r in a)
