"""``genrec loadtest``: the thin entry point over the load-test package (its flags are declared
with the other subcommands' in genrec/cli.py).

    genrec loadtest --target 127.0.0.1:50051 --qps 50,100,200 --duration 10 \\
        --workload workload.jsonl --slo-p99-ms 15 --out loadtest-out/
    genrec loadtest --make-workload data/ml1m --out workload.jsonl --n 2000
    genrec loadtest --target 127.0.0.1:50051 --qps 5,10,20 --workload repeated \\
        --repeated.catalogue=ARTIFACT --repeated.history=4000 --metrics-url http://127.0.0.1:9100/metrics

Parse (:func:`workload_of` turns ``--workload`` and the ``--repeated.KEY=VALUE`` overrides into
serialized requests), run (:func:`genrec.loadtest.runner.sweep`), report
(:func:`genrec.loadtest.report.write_outputs`). Only ever sends to ``--target``; every step is
bounded by its duration and the whole run by ``--max-requests``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

from genrec.config import ConfigError, load_config, to_dict
from genrec.loadtest.report import markdown, write_outputs
from genrec.loadtest.runner import Payloads, sweep
from genrec.loadtest.sender import choose
from genrec.loadtest.workload import (
    RepeatedUsers,
    RepeatedUserWorkload,
    catalogue_ids,
    load_workload,
    make_workload,
)


@dataclass(frozen=True)
class LoadTestFile:
    """What ``--repeated.KEY=VALUE`` overrides fill (``--workload repeated``)."""

    repeated: RepeatedUsers = field(default_factory=RepeatedUsers)


def workload_of(args: argparse.Namespace, overrides: list[str]) -> tuple[Payloads, str, str]:
    """(the requests, the method they call, a description) of ``--workload``: a JSONL file, or
    ``repeated`` configured by ``--repeated.KEY=VALUE`` overrides."""
    if args.workload != "repeated":
        return load_workload(args.workload, columns=not args.event_messages), "Recommend", str(args.workload)
    bad = [o for o in overrides if not o.startswith("--repeated.")]
    if bad:
        raise ConfigError(f"--workload repeated takes --repeated.KEY=VALUE overrides: {bad[0]}")
    cfg = load_config(LoadTestFile, None, overrides).repeated
    if not cfg.catalogue:
        raise ConfigError("repeated.catalogue is not set: --repeated.catalogue=DIR (an artifact or dataset folder)")
    workload = RepeatedUserWorkload(cfg, catalogue_ids(cfg.catalogue))
    return workload.payloads(), cfg.method, "repeated " + json.dumps(to_dict(cfg))


def cmd_loadtest(args: argparse.Namespace, overrides: list[str]) -> int:
    """``genrec loadtest``: write a workload (``--make-workload``), or sweep ``--target`` with
    one and write loadtest.json / .md / .png under ``--out``."""
    if overrides and (args.make_workload or args.workload != "repeated"):
        raise SystemExit(f"genrec loadtest takes config overrides only with --workload repeated: {overrides}")
    if args.make_workload:
        path = make_workload(args.make_workload, args.out or "workload.jsonl", n=args.n, history=args.history,
                             retrieve_k=args.retrieve_k, top_k=args.top_k, candidates=args.candidates,
                             with_actions=args.with_actions)
        print(f"wrote {path}")
        return 0
    if not args.target:
        raise SystemExit("genrec loadtest needs --target HOST:PORT (or --make-workload DATA)")
    if not args.workload:
        raise SystemExit("genrec loadtest needs --workload FILE (make one with --make-workload DATA --out FILE) "
                         "or --workload repeated")
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    sender, why = choose(args.sender)
    if why is not None:
        print(f"the Python sender sends ({why})")
    payloads, method, described = workload_of(args, overrides)
    qps = [float(x) for x in args.qps.split(",")]
    t0 = time.perf_counter()
    result = sweep(args.target, qps, args.duration, payloads, args.slo_p99_ms, args.timeout_ms / 1e3,
                   args.max_requests, progress=not args.no_progress, min_requests=args.min_requests,
                   method=method, metrics_url=args.metrics_url, tenant=args.tenant, sender=sender)
    result.workload, result.sender = described, sender
    out = write_outputs(result, args.out or "loadtest-out")
    print(markdown(result))
    print(f"\n{len(qps)} steps in {time.perf_counter() - t0:.0f}s; results in {out}/")
    return 0
