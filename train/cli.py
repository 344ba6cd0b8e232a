"""Handlers for ``genrec demo|data|train|eval`` (parsing lives in ``genrec.cli``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from genrec.config import load_config
from genrec.train.data.files import InteractionFiles
from genrec.train.data.schema import Layout, read_info


def cmd_data(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.data_cmd == "synth":
        from genrec.train.data.synthetic import SyntheticConfig, generate

        cfg = load_config(SyntheticConfig, None, overrides)
        t0 = time.perf_counter()
        info = generate(cfg, args.out, progress=not args.no_progress, layout=_layout(args))
        print(f"wrote {args.out}: {info.num_users} users, {info.num_events} events, "
              f"{info.num_items} items in [1, {info.item_id_max}] ({time.perf_counter() - t0:.1f}s)")
        return 0
    if overrides:
        raise SystemExit(f"genrec data {args.data_cmd} takes no overrides: {overrides}")
    if args.data_cmd == "convert":
        from genrec.train.data import convert

        out = {"layout": _layout(args), "progress": not args.no_progress}
        if args.format == "sequences":
            info = convert.convert_sequences(args.input, args.out, **out)
        elif args.format == "ratings":
            info = convert.convert_ratings(args.input, args.out, args.users, **out)
        elif args.format == "kuairand":
            info = convert.convert_kuairand(args.input, args.out, **out)
        else:
            info = convert.convert_movielens(args.input, args.out, **out)
        print(f"wrote {args.out}: {info.num_users} users, {info.num_events} events, {info.num_items} items, "
              f"{info.users_with_timestamps} users with timestamps")
        return 0
    return _inspect(Path(args.path), args.verify)


def _layout(args: argparse.Namespace) -> Layout:
    try:
        return Layout(files=args.files, partition=args.partition or "none")
    except ValueError as e:
        raise SystemExit(f"genrec data {args.data_cmd}: {e}") from None


def _inspect(path: Path, verify: bool = False) -> int:
    info = read_info(path)
    log = InteractionFiles(path)
    lengths = np.diff(log.read(["item_ids"]).column("item_ids").combine_chunks().offsets.to_numpy())
    print(json.dumps({k: v for k, v in info.__dict__.items() if k != "extra"}, indent=2))
    if lengths.size:
        q = np.percentile(lengths, [0, 50, 90, 99, 100]).astype(int).tolist()
        print(f"sequence length: min {q[0]}, median {q[1]}, p90 {q[2]}, p99 {q[3]}, max {q[4]}, "
              f"mean {lengths.mean():.1f}")
    if log.partitioned:
        print(f"files: {len(log.paths)}, {len(log.units)} row groups ({log.paths[0].relative_to(path)} .. "
              f"{log.paths[-1].relative_to(path)})")
    if verify:
        from genrec.train.data.verify import verify_dataset

        r = verify_dataset(path)  # raises DataFormatError naming the file and row: exit 2
        print(f"verified: {r.files} files, {r.row_groups} row groups, {r.users} users, {r.events} events: "
              "every row readable, schema, ranges and manifest consistent")
    return 0


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from genrec.config import dump_toml
    from genrec.train.job import load_job
    from genrec.train.loop.launch import run_training

    if args.resume:
        job = load_job(Path(args.resume) / "config.toml", overrides)
    else:
        job = load_job(args.config, overrides)
    if args.print_config:
        print(dump_toml(job))
        return 0
    run_dir, results = run_training(job, Path(args.resume) if args.resume else None)
    _print_results(run_dir, results)
    return 0


def _print_results(run_dir: Path, results: dict) -> None:
    from genrec.train.eval.evaluate import format_table

    best = f"; best epoch {results['best_epoch']}" if "best_epoch" in results else ""
    print(f"\nrun: {run_dir}  ({results['epochs']} epochs, {results['train_seconds']:.0f}s of training, "
          f"stopped: {results['stopped']}{best})")
    test = results.get("test", {})
    if "ndcg@10" in test:
        print(format_table({"test @ best valid": test}))
    if any("/" in k for k in test):
        print("\n" + task_table(test, "test"))


def task_table(metrics: dict, split: str) -> str:
    """The ranking tasks' metrics (``<task>/<metric>`` keys) as a markdown table, one row per
    task: AUC, GAUC, NE and ECE of the calibrated probabilities (what serving returns), and
    NE and ECE of the raw sigmoids beside them."""
    from genrec.train.eval.evaluate import format_table

    tasks = sorted({k.split("/")[0] for k in metrics if "/" in k})
    keys = ["auc", "gauc", "ne", "ece", "ne_uncalibrated", "ece_uncalibrated", "logloss", "oracle_auc",
            "positive_rate", "examples"]
    return format_table({f"{t} ({split})": {k: metrics.get(f"{t}/{k}", "") for k in keys} for t in tasks}, keys)


def load_run_model(run: Path, checkpoint: str | None, data: str | None):  # noqa: ANN201
    """(job, model with the checkpoint loaded, embedding config, checkpoint path) of a run:
    ``checkpoint`` default its best, else its newest; ``data`` another dataset directory."""
    from genrec.train.job import build_model, load_job
    from genrec.train.loop import checkpoint as ckpt

    overrides = [f'--data.path="{data}"'] if data else []
    job = load_job(run / "config.toml", overrides)
    if job.model.sid.enabled and (run / "sid.safetensors").exists():  # the run's copy of its codebook
        overrides.append(f'--model.sid.codebook="{run / "sid.safetensors"}"')
        job = load_job(run / "config.toml", overrides)
    model, emb = build_model(job)
    path = Path(checkpoint) if checkpoint else ckpt.resolve_checkpoint(run)[1]
    if not path.exists():
        raise FileNotFoundError(f"{run}: no checkpoint to evaluate (looked for {path})")
    ckpt.load_checkpoint(path, model, None)
    return job, model, emb, path


def evaluate_run(run: Path, checkpoint: str | None, split: str, data: str | None = None,
                 ranks: dict[int, int] | None = None) -> tuple[dict, Path]:
    """Metrics of a run's checkpoint (default: its best, else its newest) on ``split``, and
    that checkpoint's path: what ``genrec eval --run`` prints. A generative model's retrieval
    metrics (HR, NDCG, MRR), and with ranking tasks those of ``rank_<split>`` (keys
    ``<task>/<metric>``: the checkpoint's calibrated probabilities, as served). ``ranks``:
    filled with each user's target rank (what ``--vs`` pairs)."""
    from genrec.train.data.reader import make_reader
    from genrec.train.eval.evaluate import evaluate
    from genrec.train.eval.ranking_metrics import evaluate_ranking
    from genrec.train.job import task_masks, tokens_per_event
    from genrec.train.observe.logs import progress

    job, model, emb, path = load_run_model(run, checkpoint, data)
    metrics: dict = {}
    tpe = tokens_per_event(job)  # interleaved ranking: two tokens per event bound the history
    tasks = task_masks(job, read_info(job.data.path))
    if job.model.arch == "generative":  # tasks: a ranking model's history window, as served
        reader = make_reader(job.data, split, emb, job.model.max_seq_len, tasks=tasks, tokens_per_event=tpe)
        metrics.update(evaluate(model, progress(reader, split), job.eval, ranks=ranks))
    if tasks and job.data.ranking.enabled:
        reader = make_reader(job.data, f"rank_{split}", emb, job.model.max_seq_len, tasks=tasks,
                             tokens_per_event=tpe)
        metrics.update(evaluate_ranking(model, progress(reader, f"rank_{split}"), list(tasks)))
    return metrics, path


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from genrec.train.data.reader import make_reader
    from genrec.train.eval.evaluate import format_table
    from genrec.train.observe.logs import log, progress, run_log

    if args.vs and not args.run:
        raise SystemExit("genrec eval --vs compares two runs: give the first with --run DIR")
    if args.baseline:
        from genrec.train.eval.baselines import Baseline, evaluate_baseline
        from genrec.train.job import JobConfig, resolve_embedding

        if not args.data:
            raise SystemExit("genrec eval --baseline needs --data DIR")
        job = load_config(JobConfig, None, [f'--data.path="{args.data}"', *overrides])
        emb = resolve_embedding(job.embedding, read_info(args.data))
        reader = make_reader(job.data, args.split, emb, job.model.max_seq_len)
        metrics = evaluate_baseline(Baseline(args.data, args.baseline, job.data.valid_users),
                                    progress(reader, f"{args.baseline} baseline"), job.eval)
        name = args.baseline
    else:
        if not args.run:
            raise SystemExit("genrec eval needs --run DIR (or --baseline with --data)")
        # RUN/eval.log: what was evaluated, when, and the figures
        with run_log(Path(args.run), name="eval") if Path(args.run).is_dir() else contextlib.nullcontext():
            log.info(f"eval {args.run}: checkpoint {args.checkpoint or 'best'}, split {args.split}"
                     f"{f', data {args.data}' if args.data else ''}", extra={"file_only": True})
            if args.vs:
                retrieval_run(Path(args.run))
            ranks: dict[int, int] = {}  # (the run's per-user ranks, paired with --vs's without a second pass)
            metrics, path = evaluate_run(Path(args.run), args.checkpoint, args.split, args.data, ranks)
            log.info(f"{path}: " + json.dumps(metrics), extra={"file_only": True})
        name = f"{Path(args.run).name}/{path.name}"
    paired = paired_runs(Path(args.run), args.checkpoint, Path(args.vs), args.split, args.data,
                         ranks if args.vs else None) if args.vs else None
    if args.json:
        print(json.dumps(metrics if paired is None else {**metrics, "paired_vs": paired[0]}, indent=2))
        return 0
    tables = [format_table({f"{name} ({args.split})": metrics})] if "ndcg@10" in metrics else []
    if any("/" in k for k in metrics):
        tables.append(task_table(metrics, args.split))
    print("\n\n".join(tables + ([paired[1]] if paired else [])))
    return 0


def retrieval_run(run: Path) -> None:
    """Exits with a message unless ``run`` trained a retrieval model (what ``--vs`` pairs)."""
    from genrec.train.job import load_job

    if load_job(run / "config.toml", []).model.sid.enabled:
        raise SystemExit(f"genrec eval --vs compares retrieval runs; {run} is not one")


def paired_runs(run: Path, checkpoint: str | None, other: Path, split: str,
                data: str | None = None, first: dict[int, int] | None = None) -> tuple[dict, str]:
    """``run - other`` on ``split`` (each run's chosen checkpoint; ``checkpoint`` for ``run``),
    paired over the users both rank: {metric: (difference, standard error)} and the line that
    prints it. Two recipes read on one validation split differ far less per user than their
    means' errors say; this is the error to compare them by. ``first``: ``run``'s per-user
    ranks on ``split``, read already (then its model is not loaded again)."""
    from genrec.train.data.reader import make_reader
    from genrec.train.eval.paired import format_paired, model_ranks, paired_difference

    ranks = []
    for path, ckpt, known in ((run, checkpoint, first), (other, None, None)):
        retrieval_run(path)
        if known is not None:
            ranks.append(known)
            continue
        job, model, emb, _ = load_run_model(path, ckpt, data)
        ranks.append(model_ranks(model, make_reader(job.data, split, emb, job.model.max_seq_len), job.eval))
    diff = paired_difference(*ranks)
    users = len(ranks[0].keys() & ranks[1].keys())
    return ({k: {"difference": d, "se": se, "users": users} for k, (d, se) in diff.items()},
            format_paired(f"{run.name} ({split})", other.name, diff, users))


def cmd_demo(args: argparse.Namespace, overrides: list[str]) -> int:
    """Synthetic data (if missing) -> train configs/demo.toml -> baselines -> one table, and the
    model's paired difference from the transition baseline over the same test users."""
    from genrec.config import ConfigError
    from genrec.train.data.reader import make_reader
    from genrec.train.data.synthetic import SyntheticConfig, generate
    from genrec.train.eval.baselines import Baseline
    from genrec.train.eval.evaluate import format_table
    from genrec.train.eval.paired import (
        baseline_ranks,
        format_paired,
        model_ranks,
        paired_difference,
        rank_metrics,
    )
    from genrec.train.job import load_job, resolve_embedding
    from genrec.train.loop.launch import run_training
    from genrec.train.observe.logs import progress, run_log

    data = Path(args.data)
    job = load_job(args.config, [f'--data.path="{data}"', *overrides])
    if not job.eval.test:
        raise ConfigError("genrec demo reports the test split: eval.test = false has no place here")
    if not (data / "dataset.json").exists():
        print(f"generating synthetic ads-like logs in {data} ...")
        generate(SyntheticConfig(), data)
    else:
        _note_other_generator(data, SyntheticConfig())
    run_dir, results = run_training(job)
    name = f"{job.model.tower} (test)"
    emb_cfg = resolve_embedding(job.embedding, read_info(data))
    with run_log(run_dir):  # the baselines' warnings, too, go to RUN/train.log, not above the table
        _, model, _, _ = load_run_model(run_dir, None, None)  # the checkpoint the run tested
        ranks = {name: model_ranks(model, make_reader(job.data, "test", emb_cfg, job.model.max_seq_len), job.eval)}
        for kind in ("popular", "transition"):
            reader = make_reader(replace(job.data, context_features=False), "test", emb_cfg, job.model.max_seq_len)
            ranks[f"{kind} baseline (test)"] = baseline_ranks(Baseline(data, kind, job.data.valid_users),
                                                              progress(reader, f"{kind} baseline"), job.eval)
    rows = {k: rank_metrics(r, job.eval) for k, r in ranks.items()}
    if abs(rows[name]["ndcg@10"] - results["test"]["ndcg@10"]) > 1e-6:  # one evaluation for every row
        raise RuntimeError(f"demo: per-user ranks read test NDCG@10 {rows[name]['ndcg@10']}, "
                           f"the trainer {results['test']['ndcg@10']}")
    diff = paired_difference(ranks[name], ranks["transition baseline (test)"])
    print(f"\nrun directory: {run_dir}  ({results['epochs']} epochs, {results['train_seconds']:.0f}s training)")
    print(format_table(rows))
    print(format_paired(job.model.tower, "transition baseline", diff, len(ranks[name])))
    return 0


def _note_other_generator(data: Path, default: object) -> None:
    """One line when ``data`` was generated with other settings than today's default (an older
    ``genrec demo``'s logs are reused as they are: the table then describes those)."""
    stored = read_info(data).extra.get("synthetic") or {}
    other = {k: v for k, v in stored.items() if getattr(default, k, v) != v}
    missing = [k for k in default.__dataclass_fields__ if k not in stored] if stored else []  # type: ignore[attr-defined]
    if other or missing:
        print(f"note: {data} holds logs of other generator settings than the default "
              f"({', '.join([f'{k}={v}' for k, v in other.items()] + [f'no {k}' for k in missing])}); "
              f"remove it (or pass --data DIR) for today's")
