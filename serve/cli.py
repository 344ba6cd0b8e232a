"""Handler for ``genrec serve`` (parsing lives in ``genrec.cli``).

The server is configured like every other component: a ``ServeConfig`` (serve/server.py) read
from the ``[serve]`` section of ``--config FILE`` (configs/serve.toml lists every key), then the
alias flags (``--artifact``, ``--engine``, ``--host``, ``--port``, ``--threads``), then dotted
overrides (``--serve.batch.max_batch=16``) in that order; an unknown key is an error naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from genrec.config import ConfigError, load_config
from genrec.serve.contract import EngineBuilder
from genrec.serve.factory import SGLANG_THREADS
from genrec.serve.server import RecommenderServer, ServeConfig, kill_engine_processes
from genrec.serve.worker import plan_cpus

# sys.setswitchinterval in the front-end: the engine thread (or the gRPC threads) release the
# GIL in every torch op / C call, and Python's default 5 ms interval lets the event loop hold it
# that long before they get it back
GIL_SWITCH_S = 0.5e-3


@dataclass(frozen=True)
class ServeFile:
    """What ``genrec serve --config`` reads: a ``[serve]`` section and nothing else."""

    serve: ServeConfig = field(default_factory=ServeConfig)


def serve_config(args: argparse.Namespace, overrides: list[str]) -> ServeConfig:
    """The config from ``args.config`` (a TOML file), the alias flags given, then ``overrides``."""
    bad = [o for o in overrides if not o.startswith("--serve.")]
    if bad:
        raise ConfigError(f"genrec serve takes overrides of the [serve] section (--serve.key=value): {bad[0]}")
    flags: dict[str, Any] = {k: getattr(args, k) for k in ("artifact", "engine", "host", "port")
                             if getattr(args, k, None) is not None}
    if getattr(args, "threads", None) is not None:
        flags["process"] = {"threads": args.threads}
    cfg = load_config(ServeFile, args.config, overrides, {"serve": flags}).serve
    if not cfg.artifact:
        raise ConfigError("serve.artifact is not set: pass --artifact DIR or set artifact in the [serve] section")
    return cfg


def engine_cpus(cfg: ServeConfig, available: tuple[int, ...]) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """(each engine replica's CPUs, front-end CPUs) from ``cfg.engine_cpus``; pinning applies only
    when the engines have their own processes: the torch engine's (``serve.engine_process``) or
    SGLang's runtime, whose scheduler runs the model on one thread (``SGLangEngine(threads=1)``)."""
    if cfg.engine == "sglang":
        threads, replicas = SGLANG_THREADS, 1
    elif cfg.engine_process:
        threads, replicas = cfg.process.threads, cfg.engine_replicas
    else:
        return [], ()
    spec = cfg.engine_cpus
    spec = ",".join(map(str, spec)) if isinstance(spec, tuple) else str(spec)
    try:
        return plan_cpus(spec, threads, available, replicas)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _on_reload_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logging.getLogger("genrec.serve").error("SIGHUP reload failed: %s", task.exception())


async def _serve(cfg: ServeConfig, replica_cpus: list[tuple[int, ...]], build: EngineBuilder | None = None) -> None:
    server = RecommenderServer(cfg, cfg.artifact, replica_cpus=replica_cpus, build=build)
    port = await server.start()
    path = server.engine.path  # how the torch engine runs the tower: native, packed or jagged
    print(f"genrec serving {server.engine.version} ({server.engine.name}{f', {path} path' if path else ''}) on {cfg.host}:{port}",
          flush=True)
    if server.admin_server:
        print(f"admin on {cfg.admin.host}:{server.admin_port} (bearer token of {cfg.admin.token_file})", flush=True)
    else:
        print("admin off (no serve.admin.token_file); SIGHUP reloads the artifact", flush=True)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    loop.add_signal_handler(signal.SIGHUP,
                            lambda: loop.create_task(server.reload(server.artifact)).add_done_callback(_on_reload_failure))
    try:
        await stopping.wait()
    finally:
        print("draining ...", flush=True)
        # a second signal while draining: stop now
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _exit_now)
        try:  # bounded even if something below ignores its own timeouts
            await asyncio.wait_for(server.stop(), cfg.grace_s + 30)
        except TimeoutError:
            print("shutdown did not finish in time; stopping now", file=sys.stderr, flush=True)
            _exit_now()
        if os.environ.get("GENREC_PROFILE_OUT"):  # where time went, for the serving benchmark
            Path(os.environ["GENREC_PROFILE_OUT"]).write_text(json.dumps(server.profile(), indent=2))


def _exit_now() -> None:
    kill_engine_processes()
    os._exit(1)


def cmd_serve(args: argparse.Namespace, overrides: list[str], build: EngineBuilder | None = None) -> int:
    """``genrec serve``; ``build``: makes the engine instead of the kind ``serve.engine`` names
    (the benchmarks' naive baseline)."""
    cfg = serve_config(args, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    if cfg.process.threads:
        torch.set_num_threads(cfg.process.threads)
    engine, front = engine_cpus(cfg, tuple(sorted(os.sched_getaffinity(0))))
    if front:
        os.sched_setaffinity(0, front)
    if any(engine):
        print("engine processes on CPU " + " | ".join(",".join(map(str, c)) or "any" for c in engine)
              + "; front-end on CPU " + (",".join(map(str, front)) or "any"), flush=True)
    torch.set_float32_matmul_precision(cfg.process.matmul_precision)
    sys.setswitchinterval(GIL_SWITCH_S)
    asyncio.run(_serve(cfg, engine, build))
    return 0
