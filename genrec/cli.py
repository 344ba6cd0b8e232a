"""The ``genrec`` command: one entry point, a subcommand per job.

    genrec demo                          synthetic data -> train -> evaluate -> metrics table
    genrec data synth|convert|inspect    build and look at interaction-log datasets
    genrec train --config FILE [--a.b=v ...]
    genrec eval --run DIR [--split test] [--baseline popular|transition --data DIR]
    genrec runs list [--root runs] | show RUN | compare RUN RUN ...   the training runs
    genrec quantize --checkpoint RUN --out ARTIFACT [--embeddings int8] [--dense fp32]
    genrec sid build --checkpoint RUN [--out FILE] [--levels 256,256,256]   items -> semantic-ID codes
    genrec serve --artifact ARTIFACT [--config FILE] [--port N] [--serve.a.b=v ...]
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
    _layout_args(s)
    c = dsub.add_parser("convert", help="convert public formats (sequences, MovieLens ratings / ML-1M folder, "
                        "KuaiRand)")
    c.add_argument("format", choices=["sequences", "ratings", "movielens", "kuairand"],
                   help="sequences: 'user item item ...' lines; ratings: MovieLens ratings.dat[.gz]; "
                   "movielens: an ML-1M folder (user_sequences.txt + ratings + users.dat); "
                   "kuairand: a KuaiRand-Pure data folder (log_standard_*.csv + user_features_pure.csv)")
    c.add_argument("input", help="input file (or folder for 'movielens' and 'kuairand')")
    c.add_argument("--out", required=True, help="dataset directory to write")
    c.add_argument("--users", help="MovieLens users.dat for context features (format 'ratings')")
    c.add_argument("--no-progress", action="store_true")
    _layout_args(c)
    i = dsub.add_parser("inspect", help="print a dataset's manifest and sequence statistics")
    i.add_argument("path")
    i.add_argument("--verify", action="store_true",
                   help="also read every row group of every file and check schema, id ranges and manifest counts; "
                   "exit 2 naming the bad file and row")


def _layout_args(p: argparse.ArgumentParser) -> None:
    """Partitioned output (train/data/schema.py, Layout): an interactions/ folder, not one file."""
    p.add_argument("--files", type=int, default=1, metavar="N",
                   help="spread users over N Parquet files (by a hash of the user id) in DIR/interactions/ "
                   "(with --partition: N per partition)")
    p.add_argument("--partition", choices=["date"],
                   help="date: DIR/interactions/date=YYYY-MM-DD/ folders, each user under the UTC day of their "
                   "last event (users without timestamps under date=__HIVE_DEFAULT_PARTITION__)")


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a TOML job config",
        description="Train a model. Any config value can be overridden: --train.optim.lr=3e-4 "
        "--data.path=data/ml1m --model.tower=transformer. The same command runs under torchrun.",
    )
    p.add_argument("--config", help="job config (TOML), e.g. configs/hstu.toml")
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
    p.add_argument("--vs", metavar="RUN", help="another retrieval run: the paired difference (run - RUN, its "
                   "chosen checkpoint) over the users both rank on the split, with its standard error")


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the embedded default: synthetic data -> train -> evaluate -> table")
    p.add_argument("--data", default="data/synthetic", help="where the synthetic dataset is (created if missing)")
    p.add_argument("--config", default="demo", help="job config: a file, or the name of one shipped with genrec")


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
    p.add_argument("--index", default="auto", metavar="FACTORY",
                   help="the catalogue's ANN index: auto (IVF-PQ fast scan sized by the catalogue), none (exact "
                        "search only), or a faiss index_factory string")
    p.add_argument("--index-shortlist", type=int, default=1000, help="candidates per query re-scored exactly")
    p.add_argument("--index-recall", type=float, default=0.97,
                   help="recall@100 against exact search, on validation users, that nprobe is calibrated to")
    p.add_argument("--no-progress", action="store_true")


def _sid_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sid", help="semantic IDs: items as short codes for generative retrieval")
    ssub = p.add_subparsers(dest="sid_cmd", required=True, metavar="{build}")
    b = ssub.add_parser(
        "build",
        help="RQ-KMeans codes of a trained run's item vectors, and their trie",
        description="Residual k-means over a run's normalised item vectors: each item gets one code of "
        "len(levels) + 1 tokens (the last numbers items sharing the others). Writes OUT (safetensors) and "
        "its stats as JSON beside it (same name, .json), and prints them.",
    )
    b.add_argument("--checkpoint", required=True, help="a run directory (its best checkpoint) or a checkpoint directory")
    b.add_argument("--out", help="a .safetensors file or a directory (-> DIR/sid.safetensors); "
                   "default RUN/sid.safetensors")
    b.add_argument("--levels", default="256,256,256", help="k-means codes per level, comma separated")
    b.add_argument("--iters", type=int, default=30, help="Lloyd iterations per level (at most)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--balanced", action=argparse.BooleanOptionalAction, default=False,
                   help="balanced clusters (each level's codes used evenly) instead of plain k-means")
    b.add_argument("--sample-per-code", type=int, default=256,
                   help="fit each level's centroids on at most this many items per code, drawn at random, then "
                   "assign every item once (0: fit on all items); plain k-means only")


def _runs_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help="the training runs: a table of them, or one in full")
    rsub = p.add_subparsers(dest="runs_cmd", required=True, metavar="{list,show,compare}")
    lst = rsub.add_parser("list", help="one row per run: start, commit, data, status, best validation, test, minutes")
    lst.add_argument("--root", default="runs", help="where the runs are (searched recursively; default runs)")
    sh = rsub.add_parser("show", help="one run: its summary and every validation / test metric")
    sh.add_argument("run", help="a run directory")
    cmp = rsub.add_parser("compare", help="runs side by side: config keys that differ, metrics, validation curves")
    cmp.add_argument("runs", nargs="+", help="run directories")
    cmp.add_argument("--out", help="a PNG to draw each run's validation curve into (needs matplotlib)")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an artifact over gRPC (genrec.v1.Recommender)",
        description="gRPC ranking service: Recommend / Retrieve / Rank, health, reflection, metrics. Configured by "
        "the [serve] section of --config (ServeConfig in serve/server.py; configs/serve.toml lists every key with its "
        "default); the flags below are aliases of keys, and any key can be overridden: --serve.metrics_port=9100 "
        "--serve.batch.max_batch=16 --serve.admin.token_file=admin.token --serve.engine_cpus=[2,3]. "
        "Order: file, flags, overrides.",
    )
    p.add_argument("--config", help="TOML file with a [serve] section, e.g. configs/serve.toml")
    p.add_argument("--artifact", help="serve.artifact: artifact directory written by 'genrec quantize'")
    p.add_argument("--engine", choices=["torch", "sglang"],
                   help="serve.engine (default torch): torch: batched PyTorch engine; sglang: the tower inside SGLang "
                   "(the load-test baseline, one request at a time: python -m genrec.benchmarks.naive_engine)")
    p.add_argument("--host", help="serve.host (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="serve.port (default 50051)")
    p.add_argument("--threads", type=int, help="serve.process.threads: torch intra-op threads per engine (default 0: "
                   "torch's); with N > 0 each engine process owns N CPUs when they fit (serve.engine_cpus = \"auto\")")


def _loadtest_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="open-loop QPS sweep against a live server: percentiles, errors, max QPS",
                       description="Open-loop (Poisson) load test of genrec.v1.Recommender/Recommend. Latency is "
                       "measured from each request's scheduled send time. Only --target is ever contacted. "
                       "--workload repeated: users who come back with growing histories (Rank or Recommend), "
                       "set by --repeated.KEY=VALUE overrides (RepeatedUsers in genrec/loadtest/workload.py), e.g. "
                       "--repeated.catalogue=ARTIFACT --repeated.history=4000 --repeated.zipf=1.2 "
                       "--repeated.candidates=[100,500].")
    p.add_argument("--target", help="HOST:PORT of the server under test")
    p.add_argument("--qps", default="50,100,200", help="offered load steps, comma separated")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per step")
    p.add_argument("--min-requests", type=int, default=0, help="lengthen a step until it sends this many (a p99 "
                   "needs several hundred calls to be more than their maximum; 600 at 10 QPS: 60 s)")
    p.add_argument("--workload", help="JSONL requests (see --make-workload), or 'repeated' (see above)")
    p.add_argument("--metrics-url", help="the server's Prometheus endpoint (http://HOST:PORT/metrics, serve."
                   "metrics_port): each step then reports the cache's hit rate and memory")
    p.add_argument("--slo-p99-ms", type=float, default=15.0, help="p99 budget; failures count as over budget")
    p.add_argument("--timeout-ms", type=float, default=1000.0, help="per-call deadline")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop the whole run after this many")
    p.add_argument("--out", help="output directory (run) or workload file (--make-workload)")
    p.add_argument("--cpus", default="", help="pin the load generator to these CPUs, e.g. 0 (keep it off a "
                   "server engine's pinned CPU when both share a machine)")
    p.add_argument("--tenant", default="", help="send this caller name as 'tenant' metadata on every call "
                   "(the server's per-caller shares, [serve.fair])")
    p.add_argument("--sender", choices=("auto", "native", "python"), default="auto",
                   help="who sends: the C++ sender (genrec/loadtest/cpp, needs the gRPC C++ library: on Debian "
                   "libgrpc++-dev), which offers several thousand calls/s from one core, or this Python process "
                   "(about 2,000 calls/s a core before it sends late); auto: native where it builds")
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

    # plain text: --help is read in a terminal, not rendered (the module docstring is reST)
    parser = argparse.ArgumentParser(prog="genrec", description="The genrec command: one entry point, a "
                                     "subcommand per job.")
    parser.add_argument("--version", action="version", version=f"genrec {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in (_demo_parser, _data_parser, _train_parser, _eval_parser, _runs_parser, _quantize_parser, _sid_parser,
                _serve_parser, _loadtest_parser):
        add(sub)
    return parser


def _handler(cmd: str) -> Handler:
    if cmd in ("demo", "data", "train", "eval"):
        from genrec.train import cli

        return getattr(cli, f"cmd_{cmd}")
    if cmd == "quantize":
        from genrec.quant.cli import cmd_quantize

        return cmd_quantize
    if cmd == "runs":
        from genrec.train.runs.browse import cmd_runs

        return cmd_runs
    if cmd == "sid":
        from genrec.train.sid_build import cmd_sid

        return cmd_sid
    if cmd == "serve":
        from genrec.serve.cli import cmd_serve

        return cmd_serve
    if cmd == "loadtest":
        from genrec.loadtest.cli import cmd_loadtest

        return cmd_loadtest
    raise SystemExit(f"unknown command {cmd}")


# errors a user can fix (a bad config, a missing or damaged file): a message and exit 2, no
# traceback. Named by module, looked up only if loaded: an error of a module nobody imported
# cannot have been raised, and `genrec serve` must not load training code to catch it.
USER_ERRORS = {"genrec.config": ("ConfigError",), "genrec.embedding.spec": ("IdOutOfRange",),
               "genrec.models.sid": ("SemanticIdError",),
               "genrec.quant.artifact": ("ArtifactError",), "genrec.train.loop.checkpoint": ("IncompatibleCheckpoint",),
               "genrec.train.data.schema": ("DataFormatError",),
               "genrec.train.observe.diagnose": ("NonFiniteError",)}  # its diagnosis is already written and printed


def _user_error(e: BaseException) -> bool:
    kinds = [getattr(sys.modules[m], n) for m, names in USER_ERRORS.items() if m in sys.modules for n in names]
    return isinstance(e, (FileNotFoundError, *kinds))


def main(argv: Sequence[str] | None = None) -> int:
    # `kill -USR1 <pid>` prints every thread's Python stack: how to see where a job hangs
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --section.key=value)")
    handler = _handler(args.cmd)
    try:
        return handler(args, rest)
    except Exception as e:
        if not _user_error(e):
            raise
        from genrec.config import ConfigError  # (light: no layer is imported with it)

        kind = "config error" if isinstance(e, ConfigError) else "error"
        print(f"genrec: {kind}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
