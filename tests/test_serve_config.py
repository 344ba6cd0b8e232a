"""``genrec serve`` is configured by a [serve] section like every other component: file, alias
flags, dotted overrides; unknown keys are errors; the CLI's defaults are ServeConfig's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from genrec.cli import build_parser
from genrec.config import ConfigError, dump_toml, load_config
from genrec.serve.ann import RetrievalConfig
from genrec.serve.batcher import BatchConfig
from genrec.serve.cli import ServeFile, engine_cpus, serve_config
from genrec.serve.contract import InProcessEngine
from genrec.serve.kvcache import CacheConfig
from genrec.serve.scoring import ScoringConfig
from genrec.serve.server import ServeConfig, open_engine
from genrec.serve.worker import ProcessSettings

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*argv: str) -> ServeConfig:
    args, rest = build_parser().parse_known_args(["serve", *argv])
    return serve_config(args, rest)


def test_the_cli_with_no_flags_runs_serveconfig_defaults():
    assert _cfg("--artifact", "a") == ServeConfig(artifact="a")
    # every serve flag is an alias of a key: none has a default of its own that could drift
    args, _ = build_parser().parse_known_args(["serve"])
    assert {k: v for k, v in vars(args).items() if k != "cmd"} == dict.fromkeys(
        ("config", "artifact", "engine", "host", "port", "threads"))


def test_a_serve_file_round_trips(tmp_path):
    cfg = ServeConfig(artifact="runs/art", port=50100, engine="sglang", engine_cpus=(2, 3), engine_replicas=2,
                      batch=BatchConfig(max_batch=8, max_inflight=2), process=ProcessSettings(threads=1, poll_ms=5.0),
                      cache=CacheConfig(kv_cache_mb=64.0, window_block=16, pool_tokens=4096))
    f = tmp_path / "serve.toml"
    f.write_text(dump_toml(ServeFile(cfg)))
    assert load_config(ServeFile, f).serve == cfg
    assert _cfg("--config", str(f)) == cfg


def test_the_example_config_lists_the_defaults():
    assert load_config(ServeFile, ROOT / "configs" / "serve.toml").serve == ServeConfig()


def test_flags_override_the_file_and_dotted_overrides_override_both(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text('[serve]\nartifact = "from-file"\nport = 1\n[serve.batch]\nmax_queue_ms = 25.0\n')
    cfg = _cfg("--config", str(f), "--port", "2", "--threads", "1", "--serve.admin.load_timeout_s=60",
               "--serve.engine_cpus=[1]")
    assert (cfg.artifact, cfg.port, cfg.process.threads) == ("from-file", 2, 1)
    assert cfg.batch.max_queue_ms == 25.0 and cfg.admin.load_timeout_s == 60.0 and cfg.engine_cpus == (1,)
    assert _cfg("--config", str(f), "--port", "2", "--serve.port=3").port == 3
    assert engine_cpus(cfg, (0, 1)) == ([(1,)], (0,))


@pytest.mark.parametrize("argv, key", [
    (["--serve.no_such_key=1"], "serve.no_such_key"),
    (["--serve.batch.max_batchh=4"], "serve.batch.max_batchh"),
    (["--serve.process.cpus=[1]"], "serve.engine_cpus"),  # set per process: the error says what to set
    (["--serve.process.cache.kv_cache_mb=1"], "serve.process.cache"),  # set per process too
    (["--serve.cache.window_block=0"], "window_block"),
    (["--serve.cache.kv_cache_mb=-1"], "kv_cache_mb"),
    (["--serve.engine=tensorrt"], "tensorrt"),
    (["--serve.limits.max_history=0"], "max_history"),
    (["--train.lr=1"], "--train.lr"),
])
def test_unknown_keys_and_bad_values_are_errors_naming_them(argv, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg("--artifact", "a", *argv)


def test_a_file_with_another_section_or_no_artifact_is_an_error(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('[serve]\nport = 1\n[model]\ntower = "hstu"\n')
    with pytest.raises(ConfigError, match="'model'"):
        _cfg("--config", str(f), "--artifact", "a")
    with pytest.raises(ConfigError, match="serve.artifact"):
        _cfg()


def test_every_key_has_a_default():
    """A key without a default would make a [serve] file that omits it an error."""
    def walk(cls: type) -> None:
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
            if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
                walk(f.type)
    walk(ServeConfig)


def test_the_cache_retrieval_and_scoring_sections_reach_the_engine_in_process_and_in_an_engine_process(
        monkeypatch):
    """[serve.cache], [serve.retrieval] and [serve.scoring] are what make_engine gets: directly
    in-process, through each engine process's ProcessSettings (the child builds its engine from
    those) otherwise."""
    import genrec.serve.server as server

    cache = CacheConfig(kv_cache_mb=8.0, window_block=4, pool_tokens=512)
    retrieval = RetrievalConfig(search="exact", nprobe=3)
    scoring = ScoringConfig(candidate_precision="bf16")
    seen = []
    monkeypatch.setattr(server, "make_engine", lambda kind, art, device, c, r, s: seen.append((c, r, s)) or "engine")
    proc = SimpleNamespace(start=lambda: None, close=lambda: None)  # (made unstarted, then started: serve.loading)
    monkeypatch.setattr(server, "open_engine_process", lambda kind, art, device, settings, **kw: seen.append(settings) or proc)
    assert open_engine(ServeConfig(engine_process=False, cache=cache, retrieval=retrieval, scoring=scoring), "a") == "engine"
    assert open_engine(ServeConfig(cache=cache, retrieval=retrieval, scoring=scoring), "a") is proc
    assert seen[0] == (cache, retrieval, scoring)
    assert seen[1].cache == cache and seen[1].retrieval == retrieval and seen[1].scoring == scoring
    assert seen[1].standby


def test_the_sglang_scheduler_gets_a_cpu_of_its_own_as_the_torch_engine_process_does(monkeypatch):
    """SGLang's scheduler (where its model computes) floated over the front end's CPUs: the
    serving shape read ~0.4 ms slower a call than with it pinned. ``serve.engine_cpus`` plans it
    as it plans the torch engine's process, and the server pins the runtime it built."""
    import genrec.serve.server as server

    assert engine_cpus(ServeConfig(engine="sglang"), (0, 1)) == ([(1,)], (0,))
    assert engine_cpus(ServeConfig(engine="sglang", engine_cpus="none"), (0, 1)) == ([()], ())
    assert engine_cpus(ServeConfig(engine="sglang"), (0,)) == ([()], ())  # one CPU: nothing to separate
    pinned = []

    class Pinned(InProcessEngine):
        def run(self, works):
            return []

        def pin_to(self, cpus):
            pinned.append(cpus)

    engine = Pinned()
    monkeypatch.setattr(server, "make_engine", lambda *a: engine)
    assert open_engine(ServeConfig(engine="sglang"), "a", [(1,)]) is engine
    assert open_engine(ServeConfig(engine="sglang"), "a", [()]) is engine
    assert open_engine(ServeConfig(engine="sglang"), "a") is engine
    assert pinned == [(1,)]


def test_candidate_precision_is_checked_at_config_load_and_reaches_either_engine(monkeypatch):
    """A bad precision is refused naming the key; bf16 and auto reach TorchEngine and the SGLang
    engine (whose model scores through a TorchEngine in SGLang's scheduler: the same kernels)."""
    import genrec.serve.engine as engine_mod
    import genrec.serve.sglang_engine as sglang_mod
    from genrec.serve.factory import make_engine

    with pytest.raises(ConfigError, match="serve.scoring.candidate_precision"):
        _cfg("--artifact", "a", '--serve.scoring.candidate_precision="fp8"')
    assert _cfg("--artifact", "a", '--serve.scoring.candidate_precision="bf16"').scoring.candidate_precision == "bf16"
    got = []
    monkeypatch.setattr(engine_mod, "TorchEngine", lambda art, **kw: got.append(kw["candidate_precision"]) or "engine")
    make_engine("torch", "a", "cpu", CacheConfig(), None, ScoringConfig(candidate_precision="bf16"))
    make_engine("torch", "a", "cpu", None, None, ScoringConfig(candidate_precision="auto"))
    assert got == ["bf16", "auto"]
    monkeypatch.setattr(sglang_mod, "SGLangEngine", lambda art, **kw: got.append(kw["candidate_precision"]) or "engine")
    make_engine("sglang", "a", "cpu", CacheConfig(), None, ScoringConfig(candidate_precision="bf16"))
    make_engine("sglang", "a", "cpu", None, None, ScoringConfig(candidate_precision="auto"))
    assert got == ["bf16", "auto", "bf16", "auto"]


def test_retrieval_search_is_checked_at_config_load():
    with pytest.raises(ConfigError, match="serve.retrieval.search"):
        _cfg("--artifact", "a", '--serve.retrieval.search="fuzzy"')
    assert _cfg("--artifact", "a", '--serve.retrieval.search="exact"').retrieval.search == "exact"


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "admin.internal", "::"])
def test_plaintext_admin_on_a_non_loopback_host_is_refused_naming_the_key(host):
    """Admin's bearer token must not cross a network in the clear by accident: off loopback
    it needs TLS (its own, or the public port's) or an explicit serve.admin.insecure."""
    with pytest.raises(ConfigError, match=r"serve\.admin\.insecure") as e:
        _cfg("--artifact", "a", "--serve.admin.token_file=t", f"--serve.admin.host={host}")
    assert "serve.admin.tls" in str(e.value)
    ok = [_cfg("--artifact", "a", "--serve.admin.token_file=t", f"--serve.admin.host={host}", *extra)
          for extra in (["--serve.admin.insecure=true"], ["--serve.admin.tls.cert=c", "--serve.admin.tls.key=k"],
                        ["--serve.tls.cert=c", "--serve.tls.key=k"])]
    assert all(c.admin.host == host for c in ok)
    for loopback in ("127.0.0.1", "localhost", "::1", "[::1]"):  # loopback, or Admin off: no TLS needed
        assert _cfg("--artifact", "a", "--serve.admin.token_file=t", f"--serve.admin.host={loopback}").admin.host
    assert _cfg("--artifact", "a", f"--serve.admin.host={host}").admin.host == host
