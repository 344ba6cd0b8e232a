"""The genrec command: what each subcommand does (in process, tiny data), and one end-to-end
round trip through ``python -m genrec.cli`` subprocesses."""

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_job_overrides

ROOT = Path(__file__).resolve().parents[1]


def genrec(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "genrec.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={"TQDM_DISABLE": "1", "PATH": "/usr/bin:/bin"})
    if check and proc.returncode != 0:
        raise AssertionError(f"genrec {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def cli(capfd, *args):
    """``genrec ARGS`` in this process: (exit code, stdout, stderr), as the shell would see them."""
    from genrec.cli import main

    capfd.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse (--help, usage errors) and handlers that exit with a message
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    out = capfd.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("cmd,words", [
    ([], ["usage: genrec ", "demo", "data", "train", "eval", "quantize"]),
    (["demo"], ["usage: genrec demo ", "--data", "--config"]),
    (["data"], ["usage: genrec data ", "{synth,convert,inspect}"]),
    (["data", "synth"], ["usage: genrec data synth ", "--out", "SyntheticConfig", "--files", "--partition"]),
    (["data", "convert"], ["usage: genrec data convert ", "{sequences,ratings,movielens,kuairand}", "--users",
                           "--files", "--partition", "--no-progress"]),
    (["data", "inspect"], ["usage: genrec data inspect ", "--verify"]),
    (["train"], ["usage: genrec train ", "--config", "--resume", "--print-config"]),
    (["eval"], ["usage: genrec eval ", "--run", "--split", "--baseline", "--json", "--vs"]),
])
def test_help_names_each_commands_own_usage_and_options(capfd, cmd, words):
    code, out, _ = cli(capfd, *cmd, "--help")
    assert code == 0
    for w in words:
        assert w in out, w


def _parsers(parser):
    """``parser`` and every subcommand's parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_help_is_plain_text():
    """--help is read in a terminal: no reStructuredText from docstrings (``genrec``, :func:)."""
    from genrec.cli import build_parser

    for p in _parsers(build_parser()):
        text = p.format_help()
        for markup in ("``", ":func:", ":class:", ":mod:", ":meth:"):
            assert markup not in text, f"{p.prog} --help: {markup}"


def inspect_output(out):
    """``genrec data inspect`` stdout -> (manifest dict, sequence-length line)."""
    manifest, end = json.JSONDecoder().raw_decode(out)
    return manifest, out[end:].strip().splitlines()[0]


def test_data_synth_writes_the_dataset_that_inspect_describes(capfd, tmp_path):
    data = tmp_path / "synth"
    code, out, _ = cli(capfd, "data", "synth", "--out", data, "--no-progress", "--num_users=120", "--num_items=300",
                       "--num_topics=4", "--median_len=10", "--seed=5")
    assert code == 0
    seqs = pq.read_table(data / "interactions.parquet").column("item_ids").to_pylist()
    events = sum(map(len, seqs))
    assert len(seqs) == 120 and max(max(s) for s in seqs) <= 300
    assert f"wrote {data}: 120 users, {events} events" in out
    code, out, _ = cli(capfd, "data", "inspect", data)
    assert code == 0
    manifest, lengths = inspect_output(out)
    assert manifest["num_users"] == 120 and manifest["num_events"] == events and manifest["source"].startswith("synth")
    assert manifest["item_id_max"] == max(max(s) for s in seqs)
    q = np.percentile([len(s) for s in seqs], [0, 50, 90, 99, 100]).astype(int).tolist()
    assert lengths.startswith(f"sequence length: min {q[0]}, median {q[1]}, p90 {q[2]}, p99 {q[3]}, max {q[4]}, ")
    # the generator's settings reach it: another seed, other logs; an unknown setting is named
    cli(capfd, "data", "synth", "--out", tmp_path / "other", "--no-progress", "--num_users=120", "--num_items=300",
        "--num_topics=4", "--median_len=10", "--seed=6")
    assert pq.read_table(tmp_path / "other" / "interactions.parquet").column("item_ids").to_pylist() != seqs
    code, _, err = cli(capfd, "data", "synth", "--out", tmp_path / "x", "--num_userz=3")
    assert code == 2 and "unknown config key 'num_userz'" in err and "num_users" in err
    assert not (tmp_path / "x").exists()


def test_data_convert_writes_what_the_file_says(capfd, tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 5 6 7\n2 8 5 9 10\n")
    code, out, _ = cli(capfd, "data", "convert", "sequences", src, "--out", tmp_path / "d")
    assert code == 0 and "2 users, 7 events, 6 items, 0 users with timestamps" in out
    rows = pq.read_table(tmp_path / "d" / "interactions.parquet").to_pylist()
    assert [(r["user_id"], r["item_ids"]) for r in rows] == [(1, [5, 6, 7]), (2, [8, 5, 9, 10])]
    code, _, err = cli(capfd, "data", "convert", "sequences", src, "--out", tmp_path / "e", "--data.path=x")
    assert code == 1 and "takes no overrides" in err and not (tmp_path / "e").exists()


def test_train_print_config_resolves_the_config_file_and_overrides(capfd, tiny_config):
    code, out, _ = cli(capfd, "train", "--config", tiny_config, "--print-config", "--train.optim.lr=0.0042",
                       "--model.tower=transformer", "--data.batch_size=17")
    assert code == 0
    job = tomllib.loads(out)
    assert job["train"]["optim"]["lr"] == 0.0042 and job["model"]["tower"] == "transformer"
    assert job["data"]["batch_size"] == 17
    assert [t["name"] for t in job["embedding"]["tables"]] == ["item"] and job["embedding"]["tables"][0]["dim"] == 16


def test_bad_config_key_is_named(capfd, tiny_config):
    code, _, err = cli(capfd, "train", "--config", tiny_config, "--train.lr=1")
    assert code == 2
    assert "unknown config key 'train.lr'" in err and "optim" in err
    code, _, err = cli(capfd, "train", "--config", tiny_config, "--model.hstu.qk_dimm=8")
    assert code == 2 and "unknown config key 'model.hstu.qk_dimm'" in err and "qk_dim" in err
    code, _, err = cli(capfd, "train", "--config", tiny_config, "--model.tower=lstm")
    assert code == 2 and "model.tower" in err and "lstm" in err


def test_eval_needs_a_run_or_a_baseline_with_data(capfd, tmp_path):
    code, _, err = cli(capfd, "eval")
    assert code == 1 and "genrec eval needs --run DIR" in err
    code, _, err = cli(capfd, "eval", "--baseline", "popular")
    assert code == 1 and "--baseline needs --data DIR" in err
    code, _, err = cli(capfd, "eval", "--run", tmp_path)
    assert code == 2 and f"{tmp_path}" in err and "config.toml" in err
    # --vs compares two runs: with a baseline there is no run to pair (it crashed on a None path)
    code, _, err = cli(capfd, "eval", "--baseline", "popular", "--data", tmp_path, "--vs", tmp_path)
    assert code == 1 and "--vs compares two runs" in err


def test_data_train_eval_round_trip(tmp_path, tiny_config, monkeypatch, capfd):
    """The installed entry point end to end: data -> train (with overrides) -> eval of the run
    and of a baseline, each printing what the run directory holds."""
    from genrec.train.data.reader import make_reader
    from genrec.train.data.schema import read_info
    from genrec.train.eval.baselines import Baseline, evaluate_baseline
    from genrec.train.job import load_job, resolve_embedding

    data = tmp_path / "synth"
    out = genrec("data", "synth", "--out", data, "--no-progress", "--num_users=120", "--num_items=300",
                 "--num_topics=4", "--median_len=10").stdout
    assert "120 users" in out
    train = genrec("train", "--config", tiny_config, *tiny_job_overrides(data, tmp_path / "runs"),
                   "--train.max_epochs=2", "--train.optim.lr=0.0042", "--model.hstu.num_layers=1").stdout
    run = next((tmp_path / "runs" / "tiny").iterdir())
    for name in ("config.toml", "version.json", "env.json", "metrics.jsonl", "results.json", "curves.png"):
        assert (run / name).exists(), name
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["train"]["optim"]["lr"] == 0.0042 and config["model"]["hstu"]["num_layers"] == 1
    assert config["data"]["path"] == str(data)
    results = json.loads((run / "results.json").read_text())
    assert results["epochs"] == 2 and results["stopped"] == "max_epochs"
    test = results["test"]
    assert 0 < test["ndcg@10"] <= test["hr@10"] <= test["hr@50"] <= 1
    assert f"run: {run}  (2 epochs" in train
    assert f"| test @ best valid | {test['hr@1']:.4f} | {test['hr@10']:.4f} |" in train
    again = json.loads(genrec("eval", "--run", run, "--json").stdout)
    assert again == pytest.approx({k: v for k, v in test.items() if k in again}, abs=1e-9)
    assert again.keys() >= {"hr@10", "ndcg@10", "mrr"}
    table = genrec("eval", "--run", run).stdout
    assert f"| {run.name}/{results['best_checkpoint']} (test) | {test['hr@1']:.4f} | {test['hr@10']:.4f} |" in table
    # two runs side by side: the paired difference is that of their per-user figures on the split
    genrec("train", "--config", tiny_config, *tiny_job_overrides(data, tmp_path / "other"),
           "--train.max_epochs=1", "--model.hstu.num_layers=1")
    other = next((tmp_path / "other" / "tiny").iterdir())
    mine = json.loads(genrec("eval", "--run", run, "--split", "valid", "--json").stdout)
    theirs = json.loads(genrec("eval", "--run", other, "--split", "valid", "--json").stdout)
    paired = json.loads(genrec("eval", "--run", run, "--vs", other, "--split", "valid", "--json").stdout)["paired_vs"]
    assert paired["ndcg@10"]["users"] == mine["users"] == theirs["users"]
    for key in ("hr@10", "ndcg@10"):
        assert paired[key]["difference"] == pytest.approx(mine[key] - theirs[key], abs=1e-9)
    assert paired["ndcg@10"]["difference"] != 0 and 0 < paired["ndcg@10"]["se"] < mine["ndcg@10_se"] + theirs["ndcg@10_se"]
    assert f"{run.name} (valid) - {other.name}, paired over {mine['users']} users" in genrec(
        "eval", "--run", run, "--vs", other, "--split", "valid").stdout
    # ... reading each run's model once (the first run's ranks come from its own evaluation)
    from genrec.train import cli as train_cli

    loads, load = [], train_cli.load_run_model
    monkeypatch.setattr(train_cli, "load_run_model", lambda path, *a: loads.append(Path(path).name) or load(path, *a))
    code, out, _ = cli(capfd, "eval", "--run", run, "--vs", other, "--split", "valid", "--json")
    again = json.loads(out)["paired_vs"]
    assert code == 0 and {k: pytest.approx(v) for k, v in again.items()} == paired
    assert sorted(loads) == sorted([run.name, other.name])
    # a baseline: the CLI's numbers are the library's on the split asked for
    base = json.loads(genrec("eval", "--baseline", "transition", "--data", data, "--split", "valid", "--json").stdout)
    job = load_job(None, [f'--data.path="{data}"'])
    emb = resolve_embedding(job.embedding, read_info(data))
    want = evaluate_baseline(Baseline(data, "transition", job.data.valid_users),
                             make_reader(job.data, "valid", emb, job.model.max_seq_len), job.eval)
    assert base == pytest.approx(want, abs=1e-9) and base["hr@10"] > 0


def test_demo_output_holds_no_library_warning(tmp_path, tiny_config):
    """genrec demo's console ends in the table: PyTorch's DCP warning on saving / loading a
    checkpoint in one process ('torch.distributed is disabled ...') goes to RUN/train.log."""
    data = tmp_path / "synth"
    genrec("data", "synth", "--out", data, "--no-progress", "--num_users=120", "--num_items=300",
           "--num_topics=4", "--median_len=10")
    proc = genrec("demo", "--data", data, "--config", tiny_config, *tiny_job_overrides(data, tmp_path / "runs"),
                  "--train.max_epochs=1", "--model.hstu.num_layers=1")
    assert "Warning" not in proc.stdout + proc.stderr, proc.stderr
    assert "popular baseline (test)" in proc.stdout
    (run,) = (tmp_path / "runs" / "tiny").iterdir()
    assert "UserWarning: torch.distributed is disabled" in (run / "train.log").read_text()


def test_demo_refuses_a_run_that_reads_no_test(capfd, tmp_path, tiny_config):
    code, _, err = cli(capfd, "demo", "--data", tmp_path / "none", "--config", tiny_config, "--eval.test=false")
    assert code == 2 and "eval.test" in err
    assert not (tmp_path / "none").exists()


def test_partitioned_data_trains_and_evaluates(capfd, tmp_path, tiny_config):
    """``genrec data synth --partition date --files 2`` writes a folder of date partitions that
    inspect, verify, train and the baselines read, with the counts of the one-file dataset."""
    args = ["--no-progress", "--num_users=120", "--num_items=300", "--num_topics=4", "--median_len=10"]
    code, out, _ = cli(capfd, "data", "synth", "--out", tmp_path / "part", "--partition", "date", "--files", "2", *args)
    assert code == 0 and "120 users" in out
    days = sorted(p.name for p in (tmp_path / "part" / "interactions").iterdir())
    assert len(days) > 5 and all(d.startswith("date=20") for d in days)
    code, out, _ = cli(capfd, "data", "inspect", "--verify", tmp_path / "part")
    assert code == 0 and "files: " in out and "verified: " in out
    cli(capfd, "data", "synth", "--out", tmp_path / "one", *args)
    _, one, _ = cli(capfd, "data", "inspect", tmp_path / "one")
    assert inspect_output(out)[1] == inspect_output(one)[1]  # the same users, split otherwise
    code, _, err = cli(capfd, "data", "synth", "--out", tmp_path / "x", "--files", "0", *args)
    assert code != 0 and "--files must be at least 1" in err and not (tmp_path / "x").exists()
    genrec("train", "--config", tiny_config, *tiny_job_overrides(tmp_path / "part", tmp_path / "runs"),
           "--train.max_epochs=1", "--model.hstu.num_layers=1")
    results = json.loads(next((tmp_path / "runs" / "tiny").iterdir()).joinpath("results.json").read_text())
    assert 0 < results["test"]["hr@50"] <= 1
    base = json.loads(genrec("eval", "--baseline", "popular", "--data", tmp_path / "part", "--json").stdout)
    one = json.loads(genrec("eval", "--baseline", "popular", "--data", tmp_path / "one", "--json").stdout)
    assert base == pytest.approx(one, abs=1e-9)  # the same figures; users summed in another order


def test_malformed_data_is_named(capfd, tmp_path):
    bad = tmp_path / "seq.txt"
    bad.write_text("1 2 3\n2 4 five\n")
    code, _, err = cli(capfd, "data", "convert", "sequences", bad, "--out", tmp_path / "d")
    assert code == 2 and "seq.txt:2: 'five' is not an integer id" in err


def test_cpu_identity_tells_cpu_generations_apart(tmp_path):
    from genrec.train.runs.directory import cpu_identity

    def info(model: int, flags: str) -> Path:
        f = tmp_path / f"cpuinfo{model}"
        f.write_text(f"processor\t: 0\ncpu family\t: 25\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\n"
                     f"flags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\nmodel name\t: other\n")
        return f

    assert cpu_identity(info(17, "avx2 avx512f avx512_bf16")) == (
        "AMD EPYC (family 25 model 17, avx2+avx512f+avx512_bf16)", ["avx2", "avx512f", "avx512_bf16"])
    assert cpu_identity(info(1, "avx2")) == ("AMD EPYC (family 25 model 1, avx2)", ["avx2"])
    assert cpu_identity(tmp_path / "missing") == (None, [])


def test_bad_input_leaves_no_partial_dataset(capfd, tmp_path):
    bad = tmp_path / "seq.txt"
    bad.write_text("1 2 3 4\n2 4 5 99999999999999999999\n")
    code, _, err = cli(capfd, "data", "convert", "sequences", bad, "--out", tmp_path / "d")
    assert code == 2 and "Traceback" not in err
    assert "genrec: error: " in err and "seq.txt:2: item id 99999999999999999999 (field 4)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seq.txt"]


def small_synth(tmp_path):
    """A tiny synthetic dataset of three row groups (20 users each)."""
    from genrec.train.data.synthetic import SyntheticConfig, generate

    data = tmp_path / "synth"
    generate(SyntheticConfig(num_users=60, num_items=200, num_topics=4, median_len=8, chunk_users=20), data,
             progress=False)
    return data


def test_inspect_verify_reads_every_page_and_names_the_damaged_file(capfd, tmp_path):
    from tests.test_data import damage_page

    data = small_synth(tmp_path)
    code, out, _ = cli(capfd, "data", "inspect", "--verify", data)
    assert code == 0 and "verified: 3 files, 3 row groups, 60 users" in out
    file = damage_page(data, "timestamps", group=1)
    assert cli(capfd, "data", "inspect", data)[0] == 0  # reads item_ids only: blind to it
    code, _, err = cli(capfd, "data", "inspect", "--verify", data)
    assert code == 2 and f"genrec: error: {file} (row group 1, rows 20-39): cannot be read" in err


def test_train_on_a_damaged_dataset_names_the_file_and_leaves_no_run_dir(capfd, tmp_path, tiny_config):
    from tests.test_data import damage_page

    data = small_synth(tmp_path)
    file = damage_page(data, "timestamps", group=1)
    code, _, err = cli(capfd, "train", "--config", tiny_config, *tiny_job_overrides(data, tmp_path / "runs"),
                       "--train.max_epochs=1")
    assert code == 2 and "Traceback" not in err
    assert f"genrec: error: {file} (row group 1, rows 20-39): cannot be read as Parquet" in err
    assert not (tmp_path / "runs" / "tiny").exists()  # no run directory left for a run that never trained
