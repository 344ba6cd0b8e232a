from dataclasses import dataclass, field
from typing import Literal

import pytest

from genrec.config import ConfigError, dump_toml, from_dict, load_config, parse_override
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


def test_all_shipped_configs_load():
    from pathlib import Path

    for p in sorted(Path(__file__).parents[1].glob("configs/*.toml")):
        assert isinstance(load_job(p), JobConfig), p


def test_validation_interval_or_window_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"train.eval_every_epochs = 0: must be 1 or more .*train.evaluate = false"):
        load_job(None, ["--train.eval_every_epochs=0"])
    with pytest.raises(ConfigError, match=r"train.select_window = 0: must be 1 or more"):
        load_job(None, ["--train.select_window=0"])
    with pytest.raises(ConfigError, match=r"train.select_within_se = -1.0: must be 0 or more"):
        load_job(None, ["--train.select_within_se=-1.0"])
