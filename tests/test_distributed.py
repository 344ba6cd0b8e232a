"""Hybrid-parallel training on CPU over gloo, with real torchrun launches (2 processes).

* one sharded step equals the unsharded reference, for each sharding type that works on CPU;
* a checkpoint written on 2 ranks loads on 1 (and a 1-process one on 2) and gives the same
  model: the same test metrics, and distributed evaluation equals single-process evaluation;
* a worker SIGKILLed mid-epoch is restarted by ``torchrun --max-restarts`` and the job ends
  exactly like an uninterrupted one: the same LR and loss at every step of a warm-up + cosine
  schedule, the same final checkpoint, the same metrics; as does a one-process run killed and
  continued with ``genrec train --resume``;
* two torchrun "nodes" meeting through a c10d rendezvous on 127.0.0.1 equal one node x 2;
* shardings the device cannot do, and checkpoints of another feature spec, are refused;
* ``mode = "ddp"`` (what the default config gets under torchrun on CPU: its tables train in
  AdamW, which fbgemm cannot fuse on CPU): one replicated step equals the reference, the
  checkpoint evaluates the same in one process, and a killed worker resumes exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.conftest import tiny_job_overrides
from tests.dist.trajectory import SCHEDULE, assert_same_trajectory

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}

CONFIG = """
[[embedding.tables]]
name = "item"
features = ["item"]
dim = 16
sharding = "row_wise"
init_std = 0.05

[train]
max_epochs = 2
checkpoint_every_steps = 4
log_every_steps = 1
# fp32 GEMMs in fp32: what these tests compare is the parallel layout, and "medium" lets a CPU
# with AMX run them in bf16, where DDP and FSDP drift apart by 1.7e-5 in ten steps
matmul_precision = "highest"
""" + SCHEDULE + """
[train.parallel]
sparse_optimizer = "rowwise_adagrad"
sparse_lr = 0.05
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a launch that takes this long hangs (they take 5-25 s here, 15-45 s under load): its processes' stacks are dumped
# and it is tried once more, so a hang shows where it was instead of a bare pytest timeout
HANG_S = 150


def _descendants(pid: int) -> list[int]:
    """pid's child processes, their children, ... (torchrun starts each worker in a session
    of its own, so a process group does not reach them)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        kids = [c for c, p in parent.items() if p == todo[-1]]
        todo.pop()
        out += kids
        todo += kids
    return out


def _launch(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, str | None]:
    """Runs ``cmd``; on a hang, every Python process it started prints its threads' stacks
    (faulthandler on SIGABRT), then all are killed. Returns the process and, after a hang,
    what it printed."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=HANG_S)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err), None
    except subprocess.TimeoutExpired:
        procs = _descendants(p.pid)
        for pid in [*procs, p.pid]:  # the workers' stacks first, then the launcher's
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.communicate(timeout=20)
        for pid in [*procs, p.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = p.communicate()  # (all of it: communicate keeps what it read before a timeout)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err), f"{out[-3000:]}\n{err[-20000:]}"


def _run_dir_of(cmd: list[str]) -> Path:
    """The run directory a training command writes (``--run.out_dir`` / dist / ``--run.id``)."""
    opt = {a.split("=", 1)[0]: a.split("=", 1)[1].strip('"') for a in cmd if a.startswith("--run.")}
    return Path(opt.get("--run.out_dir", "/nonexistent")) / "dist" / opt.get("--run.id", "/nonexistent")


def run(cmd: list[str], env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc, hung = _launch(cmd, env or ENV)
    if hung is not None:
        # a RuntimeWarning: pytest's configuration hides UserWarnings (torch and SGLang raise many)
        warnings.warn(f"{' '.join(cmd)} hung for {HANG_S} s; its stacks:\n{hung}", RuntimeWarning, stacklevel=2)
        shutil.rmtree(_run_dir_of(cmd), ignore_errors=True)  # the retry starts the run afresh
        proc, again = _launch(cmd, env or ENV)
        if again is not None:
            raise AssertionError(f"{' '.join(cmd)} hung twice; the second time:\n{again}")
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


# the default recipe's parallel settings: tables in AdamW, no sharding named
DDP_CONFIG = CONFIG.replace('sharding = "row_wise"\n', "").split("[train.parallel]")[0]


def train_args(data: Path, out: Path, run_id: str, extra: list[str] = (), config: str = CONFIG) -> list[str]:
    cfg = out / "dist.toml"
    cfg.write_text(config)
    return ["-m", "genrec.cli", "train", "--config", str(cfg), *tiny_job_overrides(data, out),
            "--train.log_every_steps=1", f"--run.id={run_id}", *extra]


def results(out: Path, run_id: str) -> dict:
    return json.loads((out / "dist" / run_id / "results.json").read_text())


@pytest.mark.parametrize("ec,ebc", [("row_wise", "table_wise"), ("table_wise", "column_wise"),
                                    ("column_wise", "table_column_wise"), ("row_wise", "data_parallel"),
                                    ("ddp", "ddp")])
def test_one_sharded_step_equals_the_unsharded_reference(tmp_path, ec, ebc):
    run(TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port()), "tests/dist/one_step.py",
                    ec, ebc, str(tmp_path)])
    res = json.loads((tmp_path / "result.json").read_text())
    assert max(res["diffs"].values()) < 1e-6, res["diffs"]
    assert min(v for k, v in res["moved"].items() if k.endswith("weight")) > 1e-4  # every weight did move
    want = ("replicated on ranks [0, 1]",) * 2 if ec == "ddp" else (ec, ebc)
    assert res["plan"]["item"].startswith(want[0]) and res["plan"]["region"].startswith(want[1])


@pytest.fixture(scope="module")
def two_rank_run(tiny_synth, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run(TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port())]
        + train_args(tiny_synth, out, "straight"))
    return out


def test_two_rank_checkpoint_evaluates_the_same_in_one_process(two_rank_run):
    """2 -> 1: the checkpoint loads into the plain model; single-process evaluation equals
    the distributed evaluation the run did."""
    res = results(two_rank_run, "straight")
    single = json.loads(run([sys.executable, "-m", "genrec.cli", "eval", "--run",
                             str(two_rank_run / "dist" / "straight"), "--json"]).stdout)
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert single[k] == pytest.approx(res["test"][k], abs=1e-9), k
    sharding = json.loads((two_rank_run / "dist" / "straight" / "sharding.json").read_text())
    assert sharding["item"].startswith("row_wise on ranks [0, 1]")


def test_one_process_checkpoint_resumes_on_two_ranks(tiny_synth, tmp_path):
    """1 -> 2: a one-process (world of one) run's checkpoint resumes under torchrun."""
    run([sys.executable] + train_args(tiny_synth, tmp_path, "one", ["--train.max_steps=6"]))
    first = results(tmp_path, "one")
    run_dir = tmp_path / "dist" / "one"
    run(TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "genrec.cli", "train",
                    "--resume", str(run_dir)])
    again = results(tmp_path, "one")  # stopped at once (max_steps reached): the same model, tested on 2 ranks
    assert again["steps"] == first["steps"] == 6
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert again["test"][k] == pytest.approx(first["test"][k], abs=1e-9), k


def test_killed_worker_is_restarted_and_ends_like_an_uninterrupted_run(tiny_synth, two_rank_run):
    env = {**ENV, "GENREC_FAULTS": "kill=1:7"}  # rank 1 SIGKILLs itself after step 7 (checkpoint at 4)
    # the c10d rendezvous (as in production) starts every restart in a fresh store round; a
    # static --master-port store can hand the new workers the dead ones' addresses
    proc = run(TORCHRUN + ["--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
               + train_args(tiny_synth, two_rank_run, "killed"), env=env)
    assert proc.returncode == 0
    logged = [json.loads(x)["step"] for x in (two_rank_run / "dist" / "killed" / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "train"]
    assert logged.count(5) == 2 and logged.count(7) == 2 and logged.count(8) == 1  # steps 5-7 ran twice: killed, resumed at 4
    # resumed inside the warm-up (the checkpoint's LR is 4/5 of the configured one), with the
    # fused sparse optimizer's LR handed to fbgemm only by the optimizer's own calls
    assert_same_trajectory(two_rank_run / "dist" / "straight", two_rank_run / "dist" / "killed")
    straight, killed = results(two_rank_run, "straight"), results(two_rank_run, "killed")
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert killed["test"][k] == pytest.approx(straight["test"][k], abs=1e-6), k


def test_two_nodes_through_c10d_rendezvous_equal_one_node(tiny_synth, two_rank_run):
    port = free_port()
    args = train_args(tiny_synth, two_rank_run, "two_nodes")
    nodes = [subprocess.Popen(TORCHRUN + ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i),
                                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                          "--rdzv-id", "genrec-test"] + args,
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [n.communicate(timeout=600) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outs[0][1][-3000:] + outs[1][1][-3000:]
    one, two = results(two_rank_run, "straight"), results(two_rank_run, "two_nodes")
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert two["test"][k] == pytest.approx(one["test"][k], abs=1e-9), k


MCH_CONFIG = CONFIG.replace("dim = 16\n", """dim = 16
num_embeddings = 256
oov = "mch"
raw_id_space = 1000
mch_eviction_interval = 3
mch_buckets = 2
""").replace("rowwise_adagrad", "adagrad")


@pytest.mark.parametrize("nproc", [1, 2])
def test_managed_collision_table_sharded_row_wise_trains_through_evictions(tiny_synth, tmp_path, nproc):
    """A row-wise sharded MCH item table (fewer rows than items; DMP in one process too)
    evicts every 3 steps while a step looks the table up twice (sequence, then targets and
    negatives): the eviction's re-initialisation must not invalidate the first lookup's
    saved weights (it did: the backward failed at the first eviction, on 1 rank and on 2)."""
    cfg = tmp_path / "mch.toml"
    cfg.write_text(MCH_CONFIG)
    assert 'oov = "mch"' in MCH_CONFIG and "sparse_optimizer = \"adagrad\"" in MCH_CONFIG
    launch = [sys.executable] if nproc == 1 else TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port())]
    run(launch + ["-m", "genrec.cli", "train", "--config", str(cfg), *tiny_job_overrides(tiny_synth, tmp_path),
                  "--train.max_epochs=1", "--run.id=mch"])
    res = json.loads((tmp_path / "mch" / "mch" / "results.json").read_text())
    assert res["steps"] >= 7 and res["stopped"] == "max_epochs"  # two evictions and more
    if nproc == 1:
        return
    sharding = json.loads((tmp_path / "mch" / "mch" / "sharding.json").read_text())
    assert sharding["item"].startswith("row_wise on ranks [0, 1]")
    # one process reads one miss row where the 2 shards had one each: said, not hidden
    single = run([sys.executable, "-m", "genrec.cli", "eval", "--run", str(tmp_path / "mch" / "mch"), "--json"])
    assert "managed-collision tables were trained on 2 ranks" in single.stderr
    assert json.loads(single.stdout)["users"] == res["test"]["users"]


def test_unsupported_sharding_fails_before_training_with_the_fix(tiny_synth, tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(CONFIG + """
[[embedding.tables]]
name = "region"
features = ["region"]
dim = 8
pooling = "sum"
sharding = "row_wise"
""")
    proc = run([sys.executable, "-m", "genrec.cli", "train", "--config", str(cfg),
                *tiny_job_overrides(tiny_synth, tmp_path), "--data.context_features=true"], check=False)
    assert proc.returncode == 2
    assert "table 'region': sharding 'row_wise' is not available for pooled" in proc.stderr
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").rglob("step_*"))


def test_checkpoint_of_another_feature_spec_is_refused_naming_the_table(two_rank_run):
    from genrec.train.job import build_model, load_job
    from genrec.train.loop import checkpoint as ckpt

    run_dir = two_rank_run / "dist" / "straight"
    job = load_job(run_dir / "config.toml", ["--embedding.tables=[{name=\"item\", features=[\"item\"], dim=8}]"])
    model, _ = build_model(job)
    path = ckpt.latest_checkpoint(run_dir / "checkpoints")
    with pytest.raises(ckpt.IncompatibleCheckpoint, match=r"table 'item' has shape \[\d+, 16\] in the checkpoint but \[\d+, 8\]"):
        ckpt.load_checkpoint(path, model, None)


def test_strategy_replicates_under_torchrun_on_cpu_only_when_the_tables_train_in_adam(monkeypatch):
    from genrec.config import ConfigError
    from genrec.embedding.spec import EmbeddingConfig, TableConfig
    from genrec.train.loop.parallel import DistContext, ParallelConfig, replicate, strategy

    assert strategy(ParallelConfig()) == "none"  # one process, AdamW everywhere: the plain model
    assert strategy(ParallelConfig(sparse_optimizer="rowwise_adagrad")) == "dmp"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert strategy(ParallelConfig()) == "ddp"
    assert strategy(ParallelConfig(sparse_optimizer="adagrad")) == "dmp"
    with pytest.raises(ConfigError, match="mode = 'ddp' trains the tables in the dense AdamW; sparse_optimizer = 'sgd'"):
        strategy(ParallelConfig(mode="ddp", sparse_optimizer="sgd"))
    with pytest.raises(ConfigError, match="cannot run under torchrun"):
        strategy(ParallelConfig(mode="none"))
    emb = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=10, sharding="row_wise"),))
    with pytest.raises(ConfigError, match="table 'item': sharding 'row_wise' with train.parallel.mode = 'ddp'"):
        replicate(None, emb, None, DistContext())


@pytest.fixture(scope="module")
def ddp_run(tiny_synth, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    run(TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port())]
        + train_args(tiny_synth, out, "straight", config=DDP_CONFIG))
    return out


def test_replicated_run_evaluates_the_same_in_one_process(ddp_run):
    res = results(ddp_run, "straight")
    assert res["stopped"] == "max_epochs" and res["steps"] > 4
    sharding = json.loads((ddp_run / "dist" / "straight" / "sharding.json").read_text())
    assert sharding == {"item": "replicated on ranks [0, 1] (DDP, dense AdamW)"}
    single = json.loads(run([sys.executable, "-m", "genrec.cli", "eval", "--run",
                             str(ddp_run / "dist" / "straight"), "--json"]).stdout)
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert single[k] == pytest.approx(res["test"][k], abs=1e-9), k


def test_replicated_run_with_a_killed_worker_ends_like_an_uninterrupted_one(tiny_synth, ddp_run):
    env = {**ENV, "GENREC_FAULTS": "kill=1:7"}
    run(TORCHRUN + ["--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        + train_args(tiny_synth, ddp_run, "killed", config=DDP_CONFIG), env=env)
    logged = [json.loads(x)["step"] for x in (ddp_run / "dist" / "killed" / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "train"]
    assert logged.count(5) == 2 and logged.count(8) == 1  # killed after step 7, resumed at the step-4 checkpoint
    assert_same_trajectory(ddp_run / "dist" / "straight", ddp_run / "dist" / "killed")
    straight, killed = results(ddp_run, "straight"), results(ddp_run, "killed")
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert killed["test"][k] == pytest.approx(straight["test"][k], abs=1e-6), k


def test_one_process_run_killed_and_resumed_from_the_cli_ends_like_an_uninterrupted_one(tiny_synth, tmp_path):
    """``genrec train --resume``: a one-process run of the default recipe (the plain model,
    tables in AdamW) SIGKILLed after step 7, its newest checkpoint at step 4 inside the
    warm-up, and continued from the command line."""
    config = DDP_CONFIG  # in one process: train.parallel.mode "auto" trains the plain model
    run([sys.executable] + train_args(tiny_synth, tmp_path, "straight", config=config))
    proc = run([sys.executable] + train_args(tiny_synth, tmp_path, "killed", config=config),
               env={**ENV, "GENREC_FAULTS": "kill=0:7"}, check=False)
    run_dir = tmp_path / "dist" / "killed"
    assert proc.returncode == -9 and not (run_dir / "results.json").exists()
    run([sys.executable, "-m", "genrec.cli", "train", "--resume", str(run_dir)])
    assert_same_trajectory(tmp_path / "dist" / "straight", run_dir)
    straight, killed = results(tmp_path, "straight"), results(tmp_path, "killed")
    assert straight["stopped"] == "max_epochs"
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert killed["test"][k] == pytest.approx(straight["test"][k], abs=1e-6), k


def _any_rank_worker(rank: int, init: str, flags: list[bool], out: str) -> None:
    import torch.distributed as dist

    from genrec.train.loop.trainer import any_rank
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=len(flags))
    try:
        Path(out, str(rank)).write_text(json.dumps(any_rank(flags[rank])))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flags", [[False, True], [True, False], [False, False]])
def test_time_budget_stop_is_one_decision_for_every_rank(tmp_path, flags):
    """The time budget is read from each rank's clock; a rank whose clock says stop must stop
    every rank after the same step (a 2-rank ML-1M run once died in gloo's timeout when one rank
    stopped and the other started another step)."""
    import torch.multiprocessing as mp
    mp.spawn(_any_rank_worker, args=(f"file://{tmp_path / 'store'}", flags, str(tmp_path)), nprocs=2)
    assert [json.loads((tmp_path / str(r)).read_text()) for r in range(2)] == [any(flags)] * 2


def test_partitioned_data_on_two_ranks_survives_a_killed_worker_and_trains_the_same(tmp_path):
    """The same two-rank DDP job on a dataset in date partitions (each rank reads its own
    files and row groups): a worker killed after step 7 and restarted by torchrun ends on the
    uninterrupted run's trajectory and test metrics, and each rank keeps its log file."""
    from genrec.train.data.schema import Layout
    from genrec.train.data.synthetic import SyntheticConfig, generate

    data = tmp_path / "parts"
    cfg = SyntheticConfig(num_users=300, num_items=600, num_topics=8, median_len=12, max_len=60, seed=3,
                          chunk_users=128)
    generate(cfg, data, progress=False, layout=Layout(files=3, partition="date"))
    assert len(list((data / "interactions").rglob("*.parquet"))) >= 3
    launch = TORCHRUN + ["--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d"]
    for run_id, env in (("straight", ENV), ("killed", {**ENV, "GENREC_FAULTS": "kill=1:7"})):
        run(launch + ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
            + train_args(data, tmp_path, run_id, config=DDP_CONFIG), env=env)
    killed = tmp_path / "dist" / "killed"
    logged = [json.loads(x)["step"] for x in (killed / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "train"]
    assert logged.count(5) == 2  # resumed at the step-4 checkpoint
    assert_same_trajectory(tmp_path / "dist" / "straight", killed)
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert results(tmp_path, "killed")["test"][k] == pytest.approx(results(tmp_path, "straight")["test"][k], abs=1e-6)
    assert "diagnosis: resumed (torchrun restart 1) from" in (killed / "train.log").read_text()
    assert "job failed" not in (killed / "train.rank1.log").read_text()  # SIGKILL leaves no line: the restart speaks
