"""The genrec command end to end (subprocesses, tiny data)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_job_overrides

ROOT = Path(__file__).resolve().parents[1]


def genrec(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "genrec.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={"TQDM_DISABLE": "1", "PATH": "/usr/bin:/bin"})
    if check and proc.returncode != 0:
        raise AssertionError(f"genrec {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.parametrize("cmd", [[], ["demo"], ["data"], ["data", "synth"], ["data", "convert"], ["data", "inspect"],
                                 ["train"], ["eval"]])
def test_help_for_every_command(cmd):
    out = genrec(*cmd, "--help").stdout
    assert "usage: genrec" in out


def test_data_train_eval_round_trip(tmp_path, tiny_config):
    data = tmp_path / "synth"
    out = genrec("data", "synth", "--out", data, "--no-progress", "--num_users=120", "--num_items=300",
                 "--num_topics=4", "--median_len=10").stdout
    assert "120 users" in out
    assert "sequence length" in genrec("data", "inspect", data).stdout
    train = genrec("train", "--config", tiny_config, *tiny_job_overrides(data, tmp_path / "runs"),
                   "--train.max_epochs=2").stdout
    assert "| test @ best valid |" in train
    run = next((tmp_path / "runs" / "tiny").iterdir())
    for name in ("config.toml", "version.json", "env.json", "metrics.jsonl", "results.json", "curves.png"):
        assert (run / name).exists(), name
    results = json.loads((run / "results.json").read_text())
    again = json.loads(genrec("eval", "--run", run, "--json").stdout)
    assert again["ndcg@10"] == pytest.approx(results["test"]["ndcg@10"], abs=1e-9)
    base = genrec("eval", "--baseline", "transition", "--data", data).stdout
    assert "transition (test)" in base


def test_bad_config_key_is_named(tmp_path, tiny_config):
    proc = genrec("train", "--config", tiny_config, "--train.lr=1", check=False)
    assert proc.returncode == 2
    assert "unknown config key 'train.lr'" in proc.stderr and "optim" in proc.stderr


def test_malformed_data_is_named(tmp_path):
    bad = tmp_path / "seq.txt"
    bad.write_text("1 2 3\n2 4 five\n")
    proc = genrec("data", "convert", "sequences", bad, "--out", tmp_path / "d", check=False)
    assert proc.returncode == 2 and "seq.txt:2: 'five' is not an integer id" in proc.stderr


def test_cpu_identity_tells_cpu_generations_apart(tmp_path):
    from genrec.train.rundir import cpu_identity

    def info(model: int, flags: str) -> Path:
        f = tmp_path / f"cpuinfo{model}"
        f.write_text(f"processor\t: 0\ncpu family\t: 25\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\n"
                     f"flags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\nmodel name\t: other\n")
        return f

    assert cpu_identity(info(17, "avx2 avx512f avx512_bf16")) == (
        "AMD EPYC (family 25 model 17, avx2+avx512f+avx512_bf16)", ["avx2", "avx512f", "avx512_bf16"])
    assert cpu_identity(info(1, "avx2")) == ("AMD EPYC (family 25 model 1, avx2)", ["avx2"])
    assert cpu_identity(tmp_path / "missing") == (None, [])


def test_bad_input_leaves_no_partial_dataset(tmp_path):
    bad = tmp_path / "seq.txt"
    bad.write_text("1 2 3 4\n2 4 5 99999999999999999999\n")
    proc = genrec("data", "convert", "sequences", bad, "--out", tmp_path / "d", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "genrec: error: " in proc.stderr and "seq.txt:2: item id 99999999999999999999 (field 4)" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seq.txt"]


def small_synth(tmp_path):
    """A tiny synthetic dataset of three row groups (20 users each)."""
    from genrec.train.data.synthetic import SyntheticConfig, generate

    data = tmp_path / "synth"
    generate(SyntheticConfig(num_users=60, num_items=200, num_topics=4, median_len=8, chunk_users=20), data,
             progress=False)
    return data


def test_inspect_verify_reads_every_page_and_names_the_damaged_file(tmp_path):
    from tests.test_data import damage_page

    data = small_synth(tmp_path)
    assert "verified: 3 files, 3 row groups, 60 users" in genrec("data", "inspect", "--verify", data).stdout
    file = damage_page(data, "timestamps", group=1)
    assert genrec("data", "inspect", data, check=False).returncode == 0  # reads item_ids only: blind to it
    proc = genrec("data", "inspect", "--verify", data, check=False)
    assert proc.returncode == 2 and f"genrec: error: {file} (row group 1, rows 20-39): cannot be read" in proc.stderr


def test_train_on_a_damaged_dataset_names_the_file_and_leaves_no_run_dir(tmp_path, tiny_config):
    from tests.test_data import damage_page

    data = small_synth(tmp_path)
    file = damage_page(data, "timestamps", group=1)
    proc = genrec("train", "--config", tiny_config, *tiny_job_overrides(data, tmp_path / "runs"),
                  "--train.max_epochs=1", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"genrec: error: {file} (row group 1, rows 20-39): cannot be read as Parquet" in proc.stderr
    assert not (tmp_path / "runs" / "tiny").exists()  # no run directory left for a run that never trained
