"""FSDP2 for the dense part beside TorchRec's sharded tables (``train.parallel.dense = "fsdp"``),
2 processes over gloo, real torchrun launches, against the DDP runs of tests/test_distributed.py:

* the same seed and data train the same trajectory as DDP (the tables row-wise sharded in
  both), within the tolerance of reduction order: FSDP reduce-scatters each gradient where DDP
  all-reduces buckets, so fp32 sums run in another order (a relative 1e-7 per step; 1e-5 is
  allowed over the run), with activation checkpointing on (recomputation is the same math);
* its checkpoint (each dense tensor written as 2 row shards) reshards: one process evaluates
  it as the run did, it resumes on 1 rank with the same metrics, and on 2 DDP ranks it
  continues the FSDP run's trajectory to the same end; a one-process DDP checkpoint resumes
  on 2 FSDP ranks with the same metrics;
* a killed worker under FSDP is restarted by torchrun and ends exactly as the straight run;
* bf16 compute (``fsdp_param_dtype``) trains within bf16's rounding of the fp32 run;
* configurations FSDP cannot serve are refused, naming the fix (data-parallel tables; bf16
  layer compute with ranking tasks, whose evaluation runs layers outside forward).
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.dist.trajectory import assert_same_trajectory, checkpoint_tensors, train_records
from tests.test_distributed import CONFIG, ENV, TORCHRUN, free_port, results, run, train_args

FSDP_CONFIG = CONFIG + 'dense = "fsdp"\nactivation_checkpointing = true\n'
METRICS = ("hr@10", "ndcg@10", "mrr")


def two_ranks() -> list[str]:
    return TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port())]


@pytest.fixture(scope="module")
def runs(tiny_synth, tmp_path_factory):
    """Straight 2-rank runs: DDP dense, FSDP dense (+ activation checkpointing)."""
    out = tmp_path_factory.mktemp("fsdp")
    run(two_ranks() + train_args(tiny_synth, out, "ddp"))
    run(two_ranks() + train_args(tiny_synth, out, "fsdp", config=FSDP_CONFIG))
    return out


def assert_close_trajectory(a_dir, b_dir, rel: float) -> float:
    """Per logged step the same LR and a loss within ``rel``; returns the largest relative gap."""
    a, b = train_records(a_dir), train_records(b_dir)
    assert sorted(a) == sorted(b) and len(a) >= 10
    worst = 0.0
    for s in sorted(a):
        assert b[s]["lr"] == a[s]["lr"], f"LR at step {s}"
        gap = abs(b[s]["loss"] - a[s]["loss"]) / abs(a[s]["loss"])
        assert gap < rel, f"loss at step {s}: {a[s]['loss']} vs {b[s]['loss']}"
        worst = max(worst, gap)
    return worst


def test_fsdp_trains_the_ddp_trajectory_with_dense_tensors_sharded(runs):
    worst = assert_close_trajectory(runs / "dist" / "ddp", runs / "dist" / "fsdp", rel=1e-5)
    print(f"largest relative loss gap FSDP vs DDP: {worst:.2e}")
    ddp, fsdp = results(runs, "ddp"), results(runs, "fsdp")
    for k in METRICS:
        assert fsdp["test"][k] == pytest.approx(ddp["test"][k], abs=1e-3), k
    # the final checkpoints hold the same model and optimizer, up to reduction-order noise
    from genrec.train.loop import checkpoint as ckpt

    last = {n: ckpt.latest_checkpoint(runs / "dist" / n / "checkpoints") for n in ("ddp", "fsdp")}
    ta, tb = checkpoint_tensors(last["ddp"]), checkpoint_tensors(last["fsdp"])
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert (ta[k] - tb[k]).abs().max() <= 1e-4 + 1e-3 * ta[k].abs().max(), k
    # FSDP wrote each dense tensor as one row shard per rank; DDP wrote it whole, once
    meta = {n: dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata for n, p in last.items()}
    key = "model.tower.layers.0.uvqk.weight"
    assert len(meta["fsdp"][key].chunks) == 2 and len(meta["ddp"][key].chunks) == 1
    plan = json.loads((runs / "dist" / "fsdp" / "sharding.json").read_text())
    assert plan["item"].startswith("row_wise on ranks [0, 1]")
    assert plan["(dense)"] == "FSDP2 over ranks [0, 1]: 3 units (2 tower layers + the rest)"
    assert "(dense)" not in json.loads((runs / "dist" / "ddp" / "sharding.json").read_text())


def test_fsdp_checkpoint_evaluates_in_one_process_and_resumes_on_one_and_on_two_ddp_ranks(tiny_synth, runs):
    # 2 FSDP ranks -> 1 process: genrec eval loads the plain model and gets the run's test metrics
    single = json.loads(run([sys.executable, "-m", "genrec.cli", "eval", "--run", str(runs / "dist" / "fsdp"),
                             "--json"]).stdout)
    for k in METRICS:
        assert single[k] == pytest.approx(results(runs, "fsdp")["test"][k], abs=1e-9), k
    # an FSDP run stopped at step 6 ...
    run(two_ranks() + train_args(tiny_synth, runs, "part", ["--train.max_steps=6"], config=FSDP_CONFIG))
    part = runs / "dist" / "part"
    first = results(runs, "part")
    # ... resumes on 1 rank (a world of one; max_steps reached, so it tests at once): the same metrics
    one = runs / "dist" / "part_on_one"
    shutil.copytree(part, one)
    run([sys.executable, "-m", "genrec.cli", "train", "--resume", str(one)])
    for k in METRICS:
        assert results(runs, "part_on_one")["test"][k] == pytest.approx(first["test"][k], abs=1e-9), k
    # ... and on 2 DDP ranks continues to the FSDP straight run's end: the same steps, losses
    # within reduction-order noise, the same test metrics
    run(two_ranks() + ["-m", "genrec.cli", "train", "--resume", str(part), "--train.max_steps=0",
                       "--train.parallel.dense=ddp"])
    assert_close_trajectory(runs / "dist" / "fsdp", part, rel=1e-5)
    for k in METRICS:
        assert results(runs, "part")["test"][k] == pytest.approx(results(runs, "fsdp")["test"][k], abs=1e-3), k


def test_one_process_ddp_checkpoint_resumes_on_two_fsdp_ranks(tiny_synth, tmp_path):
    """1 -> 2 and DDP -> FSDP: a one-process run (DMP, a world of one, dense DDP) stopped at
    step 6 resumes on 2 FSDP ranks, which load its whole tensors as row shards and test the
    same model."""
    run([sys.executable] + train_args(tiny_synth, tmp_path, "one", ["--train.max_steps=6"]))
    first = results(tmp_path, "one")
    run(two_ranks() + ["-m", "genrec.cli", "train", "--resume", str(tmp_path / "dist" / "one"),
                       '--train.parallel.dense="fsdp"'])
    again = results(tmp_path, "one")
    assert again["steps"] == first["steps"] == 6
    for k in METRICS:
        assert again["test"][k] == pytest.approx(first["test"][k], abs=1e-9), k


def test_fsdp_killed_worker_is_restarted_and_ends_like_an_uninterrupted_run(tiny_synth, runs):
    env = {**ENV, "GENREC_FAULTS": "kill=1:7"}  # rank 1 SIGKILLs itself after step 7 (checkpoint at 4)
    run(TORCHRUN + ["--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        + train_args(tiny_synth, runs, "killed", config=FSDP_CONFIG), env=env)
    logged = [json.loads(x)["step"] for x in (runs / "dist" / "killed" / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "train"]
    assert logged.count(5) == 2 and logged.count(8) == 1  # steps 5-7 ran twice: killed, resumed at 4
    assert_same_trajectory(runs / "dist" / "fsdp", runs / "dist" / "killed")
    for k in METRICS:
        assert results(runs, "killed")["test"][k] == pytest.approx(results(runs, "fsdp")["test"][k], abs=1e-6), k


def test_fsdp_bf16_compute_trains_within_bf16_rounding_of_fp32(tiny_synth, runs):
    run(two_ranks() + train_args(tiny_synth, runs, "bf16", ["--train.max_steps=6",
                                                             '--train.parallel.fsdp_param_dtype="bf16"'],
                                 config=FSDP_CONFIG))
    a, b = train_records(runs / "dist" / "fsdp"), train_records(runs / "dist" / "bf16")
    gaps = [abs(b[s]["loss"] - a[s]["loss"]) / a[s]["loss"] for s in sorted(b)]
    assert len(gaps) == 6 and max(gaps) < 2e-2 and max(gaps) > 0, gaps  # bf16 did compute, and stayed close


def test_fsdp_refuses_what_it_cannot_shard():
    from genrec.config import ConfigError
    from genrec.embedding.spec import EmbeddingConfig, TableConfig
    from genrec.train.loop.parallel import DistContext, ParallelConfig, parallelize, replicate

    emb = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=10),))
    with pytest.raises(ConfigError, match="dense = 'fsdp' shards the dense part beside TorchRec's sharded tables"):
        replicate(None, emb, None, DistContext(), ParallelConfig(dense="fsdp"))
    emb = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=10),
                                  TableConfig("region", ("region",), dim=8, num_embeddings=6, pooling="sum",
                                              sharding="data_parallel")))
    with pytest.raises(ConfigError, match="data-parallel tables' gradients"):
        parallelize(None, emb, ParallelConfig(dense="fsdp", sparse_optimizer="sgd"), 0.1, None, DistContext(), 8)
    ranker = torch.nn.Module()
    ranker.ranking = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="'bf16' cannot evaluate ranking tasks.*train.precision = 'bf16'"):
        parallelize(ranker, EmbeddingConfig(tables=emb.tables[:1]),
                    ParallelConfig(dense="fsdp", sparse_optimizer="sgd", fsdp_param_dtype="bf16"), 0.1, None,
                    DistContext(), 8)
