import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from genrec.config import ConfigError, dump_toml, from_dict, load_config, parse_override, read_toml
from genrec.train.job import JobConfig, load_job


@dataclass(frozen=True)
class Opt:
    lr: float = 1e-3
    kind: Literal["a", "b"] = "a"
    ks: tuple[int, ...] = (1, 2)


@dataclass(frozen=True)
class Job:
    opt: Opt = field(default_factory=Opt)
    name: str = ""


def test_overrides_parse_as_toml_values():
    assert parse_override("--opt.lr=3e-4") == (["opt", "lr"], 3e-4)
    assert parse_override("--name=hello") == (["name"], "hello")
    assert parse_override("--opt.ks=[5, 6]") == (["opt", "ks"], [5, 6])
    job = load_config(Job, None, ["--opt.lr=2", "--opt.kind=b", "--opt.ks=[3]"])
    assert job.opt == Opt(lr=2.0, kind="b", ks=(3,))


def test_unknown_key_names_key_and_valid_keys():
    with pytest.raises(ConfigError) as e:
        from_dict(Job, {"opt": {"learning_rate": 1}})
    msg = str(e.value)
    assert "opt.learning_rate" in msg and "kind" in msg and "lr" in msg


def test_wrong_types_are_refused():
    with pytest.raises(ConfigError, match="opt.lr"):
        from_dict(Job, {"opt": {"lr": "fast"}})
    with pytest.raises(ConfigError, match="not one of"):
        from_dict(Job, {"opt": {"kind": "c"}})


def test_job_config_round_trips_through_toml(tmp_path):
    job = load_job(None, ["--model.tower=transformer", "--train.optim.lr=0.01"])
    p = tmp_path / "job.toml"
    p.write_text(dump_toml(job))
    again = load_job(p)
    assert again.model == job.model and again.train == job.train and again.embedding == job.embedding


def test_unknown_job_section_is_an_error():
    with pytest.raises(ConfigError, match="unknown config key 'trainer'"):
        load_job(None, ["--trainer.lr=1"])


def holds(resolved, written, where=""):
    """Every value ``written`` in a config file is the one ``resolved`` holds (tables and lists
    item by item): none dropped, renamed or overridden on the way in."""
    if isinstance(written, dict):
        assert isinstance(resolved, dict), where
        for k, v in written.items():
            assert k in resolved, f"{where}.{k} is not in the resolved config"
            holds(resolved[k], v, f"{where}.{k}")
    elif isinstance(written, list):
        assert isinstance(resolved, list | tuple) and len(resolved) == len(written), where
        for i, (r, w) in enumerate(zip(resolved, written)):
            holds(r, w, f"{where}[{i}]")
    else:
        assert resolved == written, f"{where}: file {written!r}, resolved {resolved!r}"


def test_all_shipped_configs_load_as_written():
    root = Path(__file__).parents[1] / "configs"
    jobs = [p for p in sorted(root.glob("*.toml")) if "serve" not in tomllib.loads(p.read_text())]
    assert len(jobs) >= 5  # the serving config ([serve]) is tests/test_serve_config.py's
    for p in jobs:
        job = load_job(p)
        assert isinstance(job, JobConfig)
        holds(tomllib.loads(dump_toml(job)), read_toml(p), p.name)  # (a file's "extends" merged in)
    # and the check sees a value that does not arrive
    with pytest.raises(AssertionError, match="model.tower: file 'hstu', resolved 'transformer'"):
        holds({"model": {"tower": "transformer"}}, {"model": {"tower": "hstu"}}, "")


def test_validation_interval_or_window_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"train.eval_every_epochs = 0: must be 1 or more .*train.evaluate = false"):
        load_job(None, ["--train.eval_every_epochs=0"])
    with pytest.raises(ConfigError, match=r"train.select_window = 0: must be 1 or more"):
        load_job(None, ["--train.select_window=0"])
    with pytest.raises(ConfigError, match=r"train.select_within_se = -1.0: must be 0 or more"):
        load_job(None, ["--train.select_within_se=-1.0"])


def test_a_shipped_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    from genrec.config import config_path

    monkeypatch.chdir(tmp_path)  # no configs/ here: `genrec demo` from a fresh directory
    for name in ("demo", "demo.toml", "configs/demo.toml"):
        assert config_path(name).read_text() == (Path(__file__).parents[1] / "configs" / "demo.toml").read_text()
    (tmp_path / "demo.toml").write_text("[train]\n")  # a file of that name wins
    assert config_path("demo.toml").resolve() == tmp_path / "demo.toml"
    with pytest.raises(ConfigError, match=r"nope.toml.*hstu.toml"):
        config_path("nope")


def test_auto_precision_is_bf16_only_where_the_cpu_has_native_bf16(monkeypatch):
    import torch

    from genrec.train.job import resolve_precision

    native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert resolve_precision("auto", None) == resolve_precision("auto", torch.device("cpu")) == ("bf16" if native else "fp32")
    assert resolve_precision("auto", torch.device("cuda")) == "fp32"
    assert [resolve_precision(p, None) for p in ("fp32", "bf16")] == ["fp32", "bf16"]
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_precision("auto", None) == "fp32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_precision("auto", None) == "bf16"
    assert load_job("configs/hstu.toml", ['--train.precision="auto"']).train.precision == "auto"
