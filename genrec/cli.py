"""The ``genrec`` command: one entry point, a subcommand per job.

    genrec demo                          synthetic data -> train -> evaluate -> metrics table
    genrec data synth|convert|inspect    build and look at interaction-log datasets
    genrec train --config FILE [--a.b=v ...]
    genrec eval --run DIR [--split test] [--baseline popular|transition --data DIR]
    genrec quantize --checkpoint RUN --out ARTIFACT [--embeddings int8] [--dense fp32]
    genrec serve --artifact ARTIFACT --engine torch|sglang --port N
    genrec loadtest --target HOST:PORT --qps 50,100,200 --duration S --workload FILE

Handlers import their layer lazily so ``--help`` answers at once. Each handler is thin:
parse, build, run; the logic lives in the layers and is tested without the CLI.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace, list[str]], int]


def _data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="create, convert and inspect interaction-log datasets")
    dsub = p.add_subparsers(dest="data_cmd", required=True, metavar="{synth,convert,inspect}")
    s = dsub.add_parser(
        "synth",
        help="generate synthetic ads-like logs",
        description="Generate synthetic ads-like logs. Generator settings are dotted overrides of "
        "SyntheticConfig (train/data/synthetic.py), e.g. --num_users=100000 --num_items=100000000.",
    )
    s.add_argument("--out", required=True, help="dataset directory to write")
    s.add_argument("--no-progress", action="store_true")
    c = dsub.add_parser("convert", help="convert public formats (sequences, MovieLens ratings / ML-1M folder)")
    c.add_argument("format", choices=["sequences", "ratings", "movielens"],
                   help="sequences: 'user item item ...' lines; ratings: MovieLens ratings.dat[.gz]; "
                   "movielens: an ML-1M folder (user_sequences.txt + ratings + users.dat)")
    c.add_argument("input", help="input file (or folder for 'movielens')")
    c.add_argument("--out", required=True, help="dataset directory to write")
    c.add_argument("--users", help="MovieLens users.dat for context features (format 'ratings')")
    i = dsub.add_parser("inspect", help="print a dataset's manifest and sequence statistics")
    i.add_argument("path")
    i.add_argument("--verify", action="store_true",
                   help="also read every row group of every file and check schema, id ranges and manifest counts; "
                   "exit 2 naming the bad file and row")


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a TOML job config",
        description="Train a model. Any config value can be overridden: --train.optim.lr=3e-4 "
        "--data.path=data/ml1m --model.tower=transformer. The same command runs under torchrun.",
    )
    p.add_argument("--config", help="job config (TOML), e.g. configs/ml1m.toml")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a trained run (or a baseline) with full-corpus ranking")
    p.add_argument("--run", help="run directory written by 'genrec train'")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's best)")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--data", help="dataset directory (default: the run's); required with --baseline")
    p.add_argument("--baseline", choices=["popular", "transition"], help="evaluate a non-neural baseline instead")
    p.add_argument("--json", action="store_true", help="print metrics as JSON")


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the embedded default: synthetic data -> train -> evaluate -> table")
    p.add_argument("--data", default="data/synthetic", help="where the synthetic dataset is (created if missing)")
    p.add_argument("--config", default="configs/demo.toml")


def _quantize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="turn a training checkpoint into a serving artifact (quantized tables, smaller dense)",
        description="Checkpoint in, serving artifact out (safetensors + manifest.json); prints the size "
        "saved and the accuracy lost on the validation split.",
    )
    p.add_argument("--checkpoint", required=True, help="a run directory (its best checkpoint) or a checkpoint directory")
    p.add_argument("--out", required=True, help="artifact directory to write")
    p.add_argument("--embeddings", choices=["fp32", "fp16", "int8", "int4"], default="int8")
    p.add_argument("--dense", choices=["fp32", "bf16", "int8", "fp8"], default="fp32")
    p.add_argument("--eval", metavar="DATA", help="dataset to measure accuracy on (default: the run's)")
    p.add_argument("--no-eval", action="store_true",
                   help="skip the accuracy measurement (sizes only; for catalogues too large to rank every user)")
    p.add_argument("--row-alignment", type=int, default=16, help="served row padding in bytes (fbgemm TBE)")
    p.add_argument("--no-progress", action="store_true")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an artifact over gRPC (genrec.v1.Recommender)",
                       description="gRPC ranking service: Recommend / Retrieve / Rank, health, reflection, metrics.")
    p.add_argument("--artifact", required=True, help="artifact directory written by 'genrec quantize'")
    p.add_argument("--engine", choices=["torch", "sglang", "naive"], default="torch",
                   help="torch: batched PyTorch engine; sglang: the tower inside SGLang; naive: one request at a "
                   "time, history encoded twice (the load-test baseline)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics HTTP port (0: off)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest",
                   help="torch.set_float32_matmul_precision. highest (torch's default) for serving on CPU: "
                   "medium hands fp32 GEMMs to oneDNN, which builds a kernel per new shape, and serving "
                   "batches change shape every call (measured: 5.5 vs 2.5 ms for a one-request batch)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the torch / naive engine in its own process, so model work never waits for the "
                   "gRPC front-end's GIL (the SGLang engine always runs in the server process)")
    p.add_argument("--engine-replicas", type=int, default=1,
                   help="engine processes of the model; each batch runs on a free one (--engine-process)")
    p.add_argument("--engine-cpus", default="auto",
                   help="CPUs of the engine process(es): auto (with --threads N: each replica owns N CPUs from the "
                   "last one down, the front-end keeps any left; no pinning when they do not fit or one engine "
                   "would own them all), none, or a list such as 1 or 2,3 (split between the replicas; the "
                   "front-end takes the other CPUs)")
    p.add_argument("--engine-poll-ms", type=float, default=0.0,
                   help="after each batch the engine process polls for the next one this long before it blocks: "
                   "on a CPU of its own (--engine-cpus) the next batch then finds it running instead of waking an "
                   "idle CPU, at the price of that CPU's time (0: block at once)")
    p.add_argument("--engine-hang-s", type=float, default=30.0,
                   help="an engine process that has not answered a batch in this long is killed: its batches fail "
                   "(INTERNAL) and the next one starts a new process")
    p.add_argument("--engine-standby", action=argparse.BooleanOptionalAction, default=True,
                   help="keep a warm standby engine process (loaded, idle, one more process's memory) that takes over "
                   "at once when the engine process dies, its batches re-run there; a new standby then loads")
    p.add_argument("--engine-start-timeout-s", type=float, default=120.0,
                   help="an engine process that has not loaded the artifact in this long is killed and the start fails")
    p.add_argument("--gil-switch-ms", type=float, default=0.5,
                   help="sys.setswitchinterval: how long a thread may hold the GIL when another waits")
    p.add_argument("--max-batch", type=int, default=32, help="requests per engine batch")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="how long a batch waits to fill")
    p.add_argument("--max-queue", type=int, default=256, help="queued requests before RESOURCE_EXHAUSTED")
    p.add_argument("--max-inflight", type=int, default=0,
                   help="batches in flight at once (0: three for one engine process, pipelined through its pipe; "
                   "else one per engine replica)")
    p.add_argument("--default-timeout-ms", type=float, default=1000.0, help="deadline of calls that set none")
    p.add_argument("--grace-s", type=float, default=10.0, help="shutdown: time for calls in flight")
    p.add_argument("--max-queue-ms", type=float, default=20.0,
                   help="admission: refuse at once (RESOURCE_EXHAUSTED) a call predicted to wait longer than this "
                   "for the engine; also refused: calls that could not finish before their deadline (0: deadline only)")
    p.add_argument("--max-history", type=int, default=4096)
    p.add_argument("--max-candidates", type=int, default=1024)
    p.add_argument("--max-retrieve", type=int, default=1024)
    s = p.add_argument_group("security", "TLS for the public port; Admin (LoadArtifact, GetModelInfo) on a listener "
                             "of its own, off unless a token file is given")
    s.add_argument("--tls-cert", default="", help="PEM certificate chain: the public port speaks TLS")
    s.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", default="", help="PEM CA: clients must present a certificate it signed (mTLS)")
    s.add_argument("--admin-host", default="127.0.0.1", help="Admin listener address (loopback: this host only)")
    s.add_argument("--admin-port", type=int, default=0, help="Admin listener port (0: any free one, printed)")
    s.add_argument("--admin-token-file", default="",
                   help="file holding the Admin bearer token (>= 16 characters); callers send "
                   "'authorization: Bearer <token>'. Without it Admin is off (SIGHUP still reloads)")
    s.add_argument("--artifact-root", default="",
                   help="LoadArtifact loads only below this folder (default: the folder holding --artifact)")
    p.add_argument("--config", help="TOML file whose [serve] section (ServeConfig in serve/server.py) applies on "
                   "top of these flags, as do --serve.key=value overrides, e.g. --serve.connections.max_concurrent_rpcs=256")


def _loadtest_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="open-loop QPS sweep against a live server: percentiles, errors, max QPS",
                       description="Open-loop (Poisson) load test of genrec.v1.Recommender/Recommend. Latency is "
                       "measured from each request's scheduled send time. Only --target is ever contacted.")
    p.add_argument("--target", help="HOST:PORT of the server under test")
    p.add_argument("--qps", default="50,100,200", help="offered load steps, comma separated")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per step")
    p.add_argument("--min-requests", type=int, default=0, help="lengthen a step until it sends this many (a p99 "
                   "needs several hundred calls to be more than their maximum; 600 at 10 QPS: 60 s)")
    p.add_argument("--workload", help="JSONL requests (see --make-workload)")
    p.add_argument("--slo-p99-ms", type=float, default=15.0, help="p99 budget; failures count as over budget")
    p.add_argument("--timeout-ms", type=float, default=1000.0, help="per-call deadline")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop the whole run after this many")
    p.add_argument("--out", help="output directory (run) or workload file (--make-workload)")
    p.add_argument("--cpus", default="", help="pin the load generator to these CPUs, e.g. 0 (keep it off a "
                   "server engine's pinned CPU when both share a machine)")
    p.add_argument("--event-messages", action="store_true", help="send each history as Event messages instead of "
                   "history_columns (packed arrays, the default: smaller and cheaper to decode)")
    p.add_argument("--no-progress", action="store_true")
    w = p.add_argument_group("workload creation")
    w.add_argument("--make-workload", metavar="DATA", help="write a workload from a dataset's latest user events")
    w.add_argument("--n", type=int, default=2000, help="requests in the workload")
    w.add_argument("--history", type=int, default=200, help="events per request history (latest)")
    w.add_argument("--retrieve-k", type=int, default=100)
    w.add_argument("--top-k", type=int, default=10)
    w.add_argument("--candidates", type=int, default=0, help="explicit candidates per request (0: retrieve)")
    w.add_argument("--with-actions", action="store_true", help="keep action bitmasks (models with an action table)")


def build_parser() -> argparse.ArgumentParser:
    from genrec import __version__

    parser = argparse.ArgumentParser(prog="genrec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"genrec {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in (_demo_parser, _data_parser, _train_parser, _eval_parser, _quantize_parser, _serve_parser,
                _loadtest_parser):
        add(sub)
    return parser


def _handler(cmd: str) -> Handler:
    if cmd in ("demo", "data", "train", "eval"):
        from genrec.train import cli

        return getattr(cli, f"cmd_{cmd}")
    if cmd == "quantize":
        from genrec.quant.cli import cmd_quantize

        return cmd_quantize
    if cmd == "serve":
        from genrec.serve.cli import cmd_serve

        return cmd_serve
    if cmd == "loadtest":
        from genrec.serve.loadtest import cmd_loadtest

        return cmd_loadtest
    raise SystemExit(f"unknown command {cmd}")


def main(argv: Sequence[str] | None = None) -> int:
    # `kill -USR1 <pid>` prints every thread's Python stack: how to see where a job hangs
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --section.key=value)")
    handler = _handler(args.cmd)
    from genrec.config import ConfigError
    from genrec.embedding.spec import IdOutOfRange
    from genrec.quant.artifact import ArtifactError
    from genrec.train.checkpoint import IncompatibleCheckpoint
    from genrec.train.data.schema import DataFormatError

    try:
        return handler(args, rest)
    except ConfigError as e:
        print(f"genrec: config error: {e}", file=sys.stderr)
        return 2
    except (DataFormatError, IdOutOfRange, FileNotFoundError, ArtifactError, IncompatibleCheckpoint) as e:
        print(f"genrec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
