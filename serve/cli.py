"""Handler for ``genrec serve`` (parsing lives in ``genrec.cli``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from genrec.config import ConfigError, apply_overrides, from_dict, merge, to_dict
from genrec.serve.batcher import BatchConfig
from genrec.serve.requests import Limits
from genrec.serve.server import (
    AdminConfig,
    RecommenderServer,
    ServeConfig,
    TLSConfig,
    kill_engine_processes,
)
from genrec.serve.worker import ProcessSettings, plan_cpus


def default_inflight(args: argparse.Namespace) -> int:
    """Batches in flight when --max-inflight is 0: three for one engine process (the next ones
    wait in its pipe while one computes, serve.worker.EngineProcess.run_async: a call that
    arrives while two batches are out is sent at once instead of waiting for the front-end to
    collect a reply), else one per engine replica (an in-process engine: one at a time)."""
    if args.engine_process and args.engine != "sglang" and args.engine_replicas == 1:
        return 3
    return args.engine_replicas


def config_from_args(args: argparse.Namespace, cpus: list[tuple[int, ...]] | None = None) -> ServeConfig:
    """``cpus``: each engine replica's CPUs (:func:`engine_cpus`)."""
    return ServeConfig(
        host=args.host, port=args.port, metrics_port=args.metrics_port, engine=args.engine, device=args.device,
        default_timeout_ms=args.default_timeout_ms, grace_s=args.grace_s,
        batch=BatchConfig(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                          max_inflight=args.max_inflight or default_inflight(args), max_queue_ms=args.max_queue_ms),
        tls=TLSConfig(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca),
        admin=AdminConfig(host=args.admin_host, port=args.admin_port, token_file=args.admin_token_file,
                          artifact_root=args.artifact_root),
        limits=Limits(max_history=args.max_history, max_candidates=args.max_candidates, max_retrieve=args.max_retrieve),
        engine_process=args.engine_process, engine_replicas=args.engine_replicas,
        process=ProcessSettings(threads=args.threads, matmul_precision=args.matmul_precision,
                                poll_ms=args.engine_poll_ms, hang_s=args.engine_hang_s,
                                standby=args.engine_standby, start_timeout_s=args.engine_start_timeout_s),
        replica_cpus=tuple(cpus or ()),
    )


def engine_cpus(args: argparse.Namespace) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """(each engine replica's CPUs, front-end CPUs); pinning applies only when the engines
    have their own processes."""
    if not args.engine_process or args.engine not in ("torch", "naive"):
        return [], ()
    return plan_cpus(args.engine_cpus, args.threads, tuple(sorted(os.sched_getaffinity(0))), args.engine_replicas)


def with_config_file(cfg: ServeConfig, path: str | None, overrides: list[str]) -> ServeConfig:
    """``cfg`` (from the flags) with a TOML file's ``[serve]`` section and ``--serve.a.b=v``
    overrides applied on top, e.g. ``--serve.connections.max_concurrent_rpcs=256``."""
    data: dict = {}
    if path:
        import tomllib

        try:
            doc = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from e
        unknown = set(doc) - {"serve"}
        if unknown:
            raise ConfigError(f"{path}: genrec serve reads the [serve] section only; found [{sorted(unknown)[0]}]")
        data = {"serve": doc.get("serve", {})}
    bad = [o for o in overrides if not o.startswith("--serve.")]
    if bad:
        raise ConfigError(f"genrec serve takes overrides of the [serve] section (--serve.key=value): {bad[0]}")
    data = apply_overrides(data, overrides).get("serve", {})
    return from_dict(ServeConfig, merge(to_dict(cfg), data), "serve") if data else cfg


def _on_reload_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logging.getLogger("genrec.serve").error("SIGHUP reload failed: %s", task.exception())


async def _serve(cfg: ServeConfig, artifact: str) -> None:
    server = RecommenderServer(cfg, artifact)
    port = await server.start()
    path = getattr(server.engine, "path", None)  # the torch engine's tower: native, padded or jagged
    print(f"genrec serving {server.engine.version} ({cfg.engine}{f', {path} path' if path else ''}) on {cfg.host}:{port}",
          flush=True)
    if server.admin_server:
        print(f"admin on {cfg.admin.host}:{server.admin_port} (bearer token of {cfg.admin.token_file})", flush=True)
    else:
        print("admin off (no --admin-token-file); SIGHUP reloads the artifact", flush=True)
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


def cmd_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine, front = engine_cpus(args)
    if front:
        os.sched_setaffinity(0, front)
    if any(engine):
        print("engine processes on CPU " + " | ".join(",".join(map(str, c)) or "any" for c in engine)
              + "; front-end on CPU " + (",".join(map(str, front)) or "any"), flush=True)
    torch.set_float32_matmul_precision(args.matmul_precision)
    # The engine thread releases the GIL in every torch op; Python's default 5 ms switch
    # interval then lets the event loop hold it that long before the engine gets it back.
    sys.setswitchinterval(args.gil_switch_ms / 1e3)
    cfg = with_config_file(config_from_args(args, engine), args.config, overrides)
    asyncio.run(_serve(cfg, args.artifact))
    return 0
