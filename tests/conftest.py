"""Shared fixtures: tiny seeded datasets and configs (the suite never reads ../shared/data),
and the test tiers.

Tiers: every test gets exactly one of these markers, here (``tier_of`` below), so nobody
marks tests by hand. ``.ci/run`` runs them all; ``-m`` picks some.

    unit     in one process, CPU, no model trained end to end: ``pytest -m unit`` is the
             check before each commit, and its budget is a minute on 2 cores
    dist     training end to end: torchrun and multi-process gloo groups, and the
             single-process training runs (resume, checkpoint choice, averaging, the CLI
             round trip) the distributed ones are checked against
    serving  starts a gRPC server, an engine process or ``genrec serve``, or trains and
             quantizes the artifact they load
    sglang   runs SGLang

A test's tier is its file's (FILE_TIERS), else its own (TEST_TIERS), else the first of SIGNS
found in its source or its fixtures' source, else unit.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
# Triton reads this when it is first imported (SGLang imports it too): without a GPU the
# kernel tests run in Triton's interpreter.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "dist", "serving", "sglang")
FILE_TIERS = {
    "test_distributed.py": "dist", "test_checkpoint.py": "dist",
    "test_serving.py": "serving", "test_serve_security.py": "serving", "test_engine_failover.py": "serving",
    "test_request_limits.py": "serving", "test_loadtest.py": "serving",
    "test_sglang.py": "sglang", "test_sglang_sid.py": "sglang",
    "test_gpu_check.py": "dist",  # its dry run trains a tiny tower and runs the paged check (~30 s)
}
# file::test (without parameters) -> tier, for what SIGNS cannot see (a helper does the work)
TEST_TIERS = {
    "test_layering.py::test_serving_loads_no_training_code": "serving",  # a fresh interpreter
    "test_layering.py::test_the_serving_check_sees_training_code_when_it_is_loaded": "serving",  # per check
}
# what a test or one of its fixtures does -> tier; the first match wins
SIGNS = (
    ("sglang", ("import sglang", "from sglang", "SGLangEngine", "sglang_engine")),
    ("dist", ("torchrun", "TORCHRUN", "torch.distributed.run", "mp.spawn", "init_process_group")),
    ("serving", ("ThreadedServer", "grpc.server(", "grpc.aio.server(", "EngineProcess(", "FailoverEngine(",
                 "EnginePool(", '"genrec.cli", "serve"', "tiny_ranking_artifact(", "QuantizeConfig(")),
    ("dist", ("run_training(", 'genrec("train"', 'genrec("demo"')),
)


def _ours(func: object) -> bool:
    try:
        return Path(inspect.getsourcefile(func) or "").parent == TESTS  # type: ignore[arg-type]
    except TypeError:
        return False


def _sources(item: pytest.Item) -> str:
    """The test function's source and that of every fixture it uses."""
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        funcs += [d.func for d in defs if _ours(d.func)]
    out = []
    for f in funcs:
        try:
            out.append(inspect.getsource(f))
        except (OSError, TypeError):
            pass
    return "\n".join(out)


def native_or_skip(why: str | None) -> None:
    """For a test of a native program (genrec.native_build): skip where it cannot be built here
    (``why``), except under CI, where .ci/run installs the gRPC C++ library and sets
    GENREC_REQUIRE_NATIVE: there it fails."""
    if why is not None and os.environ.get("GENREC_REQUIRE_NATIVE"):
        pytest.fail(why)
    if why is not None:
        pytest.skip(why)


def kernel_or_skip(library: object, source: str) -> None:
    """For a test of a native kernel (kernels.native): fail where ``source`` did not build
    (a C++ compiler is part of the set-up), skip where native kernels are off (GENREC_NATIVE=0)."""
    if library is None:
        from genrec.kernels import native

        if native.enabled():
            pytest.fail(f"kernels/cpu/{source} did not build (a C++ compiler is part of the set-up)")
        pytest.skip("native kernels off (GENREC_NATIVE=0)")


def tier_of(item: pytest.Item) -> str:
    file = item.path.name
    if file in FILE_TIERS:
        return FILE_TIERS[file]
    name = f"{file}::{getattr(item, 'originalname', item.name)}"
    if name in TEST_TIERS:
        return TEST_TIERS[name]
    src = _sources(item)
    for tier, signs in SIGNS:
        if any(s in src for s in signs):
            return tier
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before -m deselects on the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad = []
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, tier_of(item)))
        marks = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(marks) != 1:
            bad.append(f"{item.nodeid}: {sorted(marks)}")
    if bad:
        raise pytest.UsageError("each test needs exactly one tier marker of " + ", ".join(TIERS) + ":\n  "
                                + "\n  ".join(bad))


@pytest.fixture(scope="session")
def tiny_synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from genrec.train.data.synthetic import SyntheticConfig, generate

    out = tmp_path_factory.mktemp("synth") / "data"
    cfg = SyntheticConfig(num_users=300, num_items=600, num_topics=8, median_len=12, max_len=60, seed=3,
                          chunk_users=128)
    generate(cfg, out, progress=False)
    return out


def tiny_job_overrides(data: Path, out: Path) -> list[str]:
    return [
        f'--data.path="{data}"',
        "--data.batch_size=32",
        "--data.eval_batch_size=64",
        "--model.max_seq_len=32",
        "--model.hstu.qk_dim=16",
        "--model.hstu.v_dim=16",
        "--model.retrieval.num_negatives=32",
        "--train.progress=false",
        "--train.log_every_steps=2",
        f'--run.out_dir="{out}"',
    ]


TINY_TABLES = """
[[embedding.tables]]
name = "item"
features = ["item"]
dim = 16
"""


@pytest.fixture()
def tiny_config(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(TINY_TABLES)
    return p
