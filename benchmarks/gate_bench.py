"""The regression gate's micro-benchmarks: what one side (one commit's code) runs.

``benchmarks/gate.py`` copies this file out of the repository and runs it as a script with
``python -P`` and ``PYTHONPATH`` set to a side's import shim, so ``import genrec`` below is
that commit's code, while the measuring code (this file) is the same for both sides. It uses
only long-lived entry points of the package (job loading, the trainer's ``train_step``, the
export, the serving engine), never ``genrec.benchmarks``, which an older commit may lack.

    python -P gate_bench.py prepare --job JOB.toml --data DIR --out DIR
    python -P gate_bench.py worker --job JOB.toml --data DIR --artifact DIR --workload FILE

``prepare`` trains the job two steps and exports it (int8 tables): the side's own serving
artifact, so a change to the export is measured too, and warms the side's bytecode and
native-kernel caches.

``worker`` builds both benchmarks, warms them up, prints ``ready`` and the files its
``genrec`` modules came from (one JSON line), then runs one block a command read from stdin
and answers each with one JSON line, until ``quit``. The gate keeps the base's and the head's
workers alive together and sends blocks to them in turn, so the two sides are compared over
the same second of a busy machine, not over different minutes:

* ``train``: ``--steps`` calls of the trainer's ``train_step`` (forward, backward, optimizer,
  the step accounting) on the same batches every block, read before any clock starts;
* ``serve``: ``TorchEngine.run`` on ``--serve-batches`` batches of ``--batch`` recommend
  requests (retrieve, then rank the retrieved candidates), decoded before any clock starts.

A block's answer is its CPU time (this process's, ``time.process_time``) and wall time in ms
per step or per engine call. CPU time leaves out the time the process waited for a core
another process held, the largest noise on a shared machine; one torch thread keeps CPU time
and work in proportion.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# modules that moved, by their path now and before (a base before the 2026-12-04 layout, where
# train/ was flat and the load generator lived in serve/): each side imports its own
MOVED = {"genrec.train.loop.trainer": "genrec.train.trainer", "genrec.train.loop.launch": "genrec.train.run",
         "genrec.loadtest.workload": "genrec.serve.loadtest"}


def _module(name: str) -> Any:  # noqa: ANN401 - a module
    """``name``, or where it was before it moved (:data:`MOVED`). The old path is tried first:
    only a side from before the move has it, while the new path could still be found outside the
    side's tree (the editable install's finder maps genrec.* to the checkout it came from)."""
    import importlib

    if name in MOVED:
        try:
            return importlib.import_module(MOVED[name])
        except ModuleNotFoundError:
            pass
    return importlib.import_module(name)


def _modules() -> dict[str, str]:
    """Where the measured code came from: each module's file with symlinks resolved."""
    import genrec
    import genrec.serve.engine

    trainer = _module("genrec.train.loop.trainer")
    return {m.__name__: os.path.realpath(m.__file__) for m in (genrec, trainer, genrec.serve.engine)}


def _job(args: argparse.Namespace, extra: list[str] = ()) -> Any:  # noqa: ANN401 - the side's JobConfig
    from genrec.train.job import load_job

    return load_job(args.job, [f'--data.path="{args.data}"', f"--train.threads={args.threads}",
                               "--train.progress=false", *extra])


def prepare(args: argparse.Namespace) -> None:
    """Trains the job for two steps and exports it to ``args.out/artifact``."""
    from genrec.quant.convert import QuantizeConfig, export

    run_training = _module("genrec.train.loop.launch").run_training

    out = Path(args.out)
    job = _job(args, ["--train.max_steps=2", "--train.evaluate=false", f'--run.out_dir="{out / "runs"}"'])
    run_dir, _ = run_training(job)
    export(run_dir, out / "artifact", QuantizeConfig(embeddings="int8"), progress=False, measure_accuracy=False)
    (out / "prepare.json").write_text(json.dumps({"artifact": str(out / "artifact"), "modules": _modules()}) + "\n")


def _timed(fn: Any, items: list[Any]) -> dict[str, float]:  # noqa: ANN401
    """CPU and wall ms per call of ``fn`` over ``items``."""
    c0, t0 = time.process_time(), time.perf_counter()
    for x in items:
        fn(x)
    return {"cpu_ms": 1e3 * (time.process_time() - c0) / len(items),
            "wall_ms": 1e3 * (time.perf_counter() - t0) / len(items)}


class Bench:
    """Both benchmarks of one side, built and warmed up: ``block(kind)`` runs one block."""

    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        from genrec.serve.engine import TorchEngine
        from genrec.serve.requests import Limits, decode
        from genrec.train.data.reader import make_reader
        from genrec.train.data.schema import read_info
        from genrec.train.job import build_model, task_masks, tokens_per_event

        load_workload = _module("genrec.loadtest.workload").load_workload
        trainer = _module("genrec.train.loop.trainer")
        Trainer, build_optimizer = trainer.Trainer, trainer.build_optimizer  # noqa: N806 - a class

        job = _job(args)
        torch.manual_seed(job.train.seed)
        model, emb = build_model(job)
        tasks = task_masks(job, read_info(job.data.path))
        reader = make_reader(job.data, "train", emb, job.model.max_seq_len, seed=job.train.seed, tasks=tasks,
                             tokens_per_event=tokens_per_event(job))
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], job.train.optim)
        self.trainer = Trainer(job.train, job.eval, run_dir, model, model, optimizer, reader, {}, {},
                               tasks=list(tasks))
        self.batches = list(itertools.islice(reader, args.steps))  # the same batches every block
        # --train-method: the evidence times an injected step beside the original it wraps
        self.step = getattr(self.trainer, args.train_method)
        self.engine = TorchEngine(args.artifact)
        works = [decode("recommend", p, self.engine.schema, Limits()) for p in load_workload(args.workload)]
        self.requests = [works[i * args.batch : (i + 1) * args.batch] for i in range(args.serve_batches)]
        if len(self.requests[-1]) < args.batch:
            raise SystemExit(f"{args.workload}: fewer than {args.serve_batches} x {args.batch} requests")
        for _ in range(args.warmup):  # the first step counts FLOPs; allocator and caches warm
            self.block("train")
            self.block("serve")

    def block(self, kind: str) -> dict[str, float]:
        if kind == "train":
            return _timed(self.step, self.batches)
        return _timed(self.engine.run, self.requests)


def worker(args: argparse.Namespace) -> None:
    # stdout carries the protocol alone: whatever the package prints goes to stderr
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    with tempfile.TemporaryDirectory() as run_dir:
        bench = Bench(args, Path(run_dir))
        proto.write(json.dumps({"ready": True, "modules": _modules(), "threads": torch.get_num_threads()}) + "\n")
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "quit":
                break
            if cmd not in ("train", "serve"):
                raise SystemExit(f"gate_bench worker: unknown command {cmd!r}")
            proto.write(json.dumps(bench.block(cmd)) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("prepare", "worker"))
    ap.add_argument("--job", required=True, help="the job config (TOML) both sides train")
    ap.add_argument("--data", required=True, help="the dataset directory both sides read")
    ap.add_argument("--out", help="prepare: the directory to write")
    ap.add_argument("--artifact", help="worker: the side's artifact (from prepare)")
    ap.add_argument("--workload", help="worker: recommend requests (JSONL)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="training steps in a block")
    ap.add_argument("--batch", type=int, default=8, help="requests in one engine call")
    ap.add_argument("--serve-batches", type=int, default=8, help="engine calls in a block")
    ap.add_argument("--warmup", type=int, default=1, help="untimed blocks of each kind first")
    ap.add_argument("--train-method", default="train_step", help="the Trainer method a step calls")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prepare(args) if args.mode == "prepare" else worker(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
