"""Imports point one way (ENGINEERING.md, "The shape of the system"):

    kernels <- embedding <- models <- train / quant / serve;   benchmarks -> anything

* kernels import nothing of ours; embedding only kernels; models only embedding and kernels,
  and never torch.distributed, gRPC or SGLang; train never serve, quant, proto, gRPC or SGLang.
* Serving never loads training code (checked by importing it, in a fresh interpreter).
* The load generator (``genrec/loadtest/``) is a client: proto + numpy + gRPC. It imports nothing
  of the server, training, models or the layers below them, nor torch (checked in its source
  and by importing it in a fresh interpreter); the server never imports it.
* SGLang: one module per process imports ``sglang`` (or ``sgl_kernel``), at any depth of the
  tree: ``serve/sglang_runtime.py`` in the server's process (under the engine's front end,
  ``serve/sglang_engine.py``) and ``serve/sglang_models/genrec_tower.py`` in SGLang's scheduler
  (the model). Every module outside those and ``serve/sglang_models/`` reaches them lazily
  (inside a function, ``serve.factory.make_engine``).
* The modules of ``serve/`` import each other without a cycle (a function-level import counts:
  it is the same seam, taken later).
* No product module (genrec/, serve/, train/, quant/, models/, embedding/, kernels/, proto/)
  imports ``genrec.benchmarks``, a development folder.
* Everything imports our folders by their installed names (``genrec.serve``), never by the bare
  folder name (``import serve``, ``from train.x import y``), which works only from the
  repository root.

Each check is a function of a source tree; ``test_each_check_fails_on_a_broken_tree`` runs it on
a small tree that breaks it, so no check passes by checking nothing.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> installed package (pyproject.toml, [tool.setuptools.package-dir])
PACKAGES = {"genrec": "genrec", "kernels": "genrec.kernels", "embedding": "genrec.embedding",
            "models": "genrec.models", "train": "genrec.train", "quant": "genrec.quant", "serve": "genrec.serve",
            "proto/genrec": "genrec.proto", "benchmarks": "genrec.benchmarks", "genrec/loadtest": "genrec.loadtest"}
FOLDERS = {"kernels", "embedding", "models", "train", "quant", "serve", "proto", "benchmarks"}
PRODUCT = ("genrec", "serve", "train", "quant", "models", "embedding", "kernels", "proto/genrec")


def modules(root: Path, folder: str) -> dict[str, Path]:
    """Installed module name -> file, for the .py files of ``folder`` (generated protobuf included)."""
    base, package = root / folder, PACKAGES[folder]
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(absolute module name, at module level) of every import in ``path``; relative imports
    resolved against ``module``; ``from a import b`` yields ``a.b`` (b may be a module) and ``a``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, (ast.If, ast.Try))
                                        for n in ast.walk(s)}
    found = []
    for node in ast.walk(tree):
        level = id(node) in top
        if isinstance(node, ast.Import):
            found += [(a.name, level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.append((base, level))
            found += [(f"{base}.{a.name}", level) for a in node.names if a.name != "*"]
    return found


def _matches(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_offenders(root: Path, folder: str, allowed: set[str] | None, forbidden: set[str] = frozenset()) -> list[str]:
    """Imports in ``folder`` of ``forbidden`` modules (torch.distributed, grpc, genrec.serve, ...)
    and, unless ``allowed`` is None, of anything of ours (genrec.config included) outside the
    folder and the ``allowed`` folders."""
    own = {PACKAGES[f] for f in (allowed or set()) | {folder}}
    bad = []
    for mod, path in modules(root, folder).items():
        for name, _ in imports(path, mod):
            outside = allowed is not None and _matches(name, {"genrec"}) and not _matches(name, own)
            if outside or _matches(name, set(forbidden)):
                bad.append(f"{path.relative_to(root)}: {name}")
    return sorted(set(bad))


# what a client of the gRPC contract has no use for: everything of ours but the proto and
# genrec.config (its --repeated.* overrides), and torch
NOT_FOR_CLIENTS = {"genrec.serve", "genrec.train", "genrec.models", "genrec.quant", "genrec.embedding", "genrec.kernels",
                   "genrec.benchmarks", "genrec.cli", "torch", "sglang", "sgl_kernel"}


def client_offenders(root: Path) -> list[str]:
    """Imports in genrec/loadtest/ of what a client of the gRPC contract should not need."""
    return layer_offenders(root, "genrec/loadtest", None, NOT_FOR_CLIENTS)


def load_generator_importers(root: Path) -> list[str]:
    """Imports of the load generator by the server."""
    return layer_offenders(root, "serve", None, {"genrec.loadtest"})


# the modules that import SGLang: one per process (the server's front end, SGLang's scheduler)
SGLANG_IMPORTERS = {"genrec.serve.sglang_runtime", "genrec.serve.sglang_models.genrec_tower"}
SGLANG_SIDE = {"genrec.serve.sglang_engine", "genrec.serve.sglang_runtime", "genrec.serve.sglang_models"}


def sglang_offenders(root: Path) -> list[str]:
    """Modules of serve/ that import SGLang other than its two (one per process), and modules
    outside the SGLang engine's own that import any of them at module level."""
    importers, bad = set(), []
    for mod, path in modules(root, "serve").items():
        names = imports(path, mod)
        if any(_matches(n, {"sglang", "sgl_kernel"}) for n, _ in names):
            importers.add(mod)
        if not _matches(mod, SGLANG_SIDE) and any(_matches(n, SGLANG_SIDE) and top for n, top in names):
            bad.append(f"{mod} imports the SGLang engine at module level")
    if importers != SGLANG_IMPORTERS:
        bad.append(f"modules importing sglang: {sorted(importers)} (exactly {sorted(SGLANG_IMPORTERS)} should)")
    return bad


def serve_cycles(root: Path) -> list[list[str]]:
    """Import cycles among the modules of serve/ (every import, function-level included)."""
    mods = modules(root, "serve")
    graph = {m: sorted({n for n, _ in imports(p, m) if n in mods and n != m}) for m, p in mods.items()}
    cycles, state = [], {}  # state: 1 on the DFS stack, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def benchmark_importers(root: Path) -> list[str]:
    return sorted(f"{path.relative_to(root)}: {name}" for folder in PRODUCT
                  for mod, path in modules(root, folder).items()
                  for name, _ in imports(path, mod) if _matches(name, {"genrec.benchmarks"}))


def bare_imports(root: Path) -> list[str]:
    """Imports of our folders by their bare names, anywhere in the repository."""
    bad = []
    tops = [p for p in sorted(root.iterdir()) if not p.name.startswith(".") and "egg-info" not in p.name
            and p.name not in ("build", "runs", "data")]
    paths = [p for t in tops for p in ([t] if t.suffix == ".py" else sorted(t.rglob("*.py")) if t.is_dir() else [])]
    for path in paths:
        for name, _ in imports(path, "genrec.x"):  # (relative imports resolve under genrec: never bare)
            if name.split(".")[0] in FOLDERS:
                bad.append(f"{path.relative_to(root)}: {name}")
    return sorted(set(bad))


def loaded_modules(statements: str) -> list[str]:
    """Our modules loaded by running ``statements`` in a fresh interpreter."""
    code = f"import json, sys\n{statements}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


SERVING = ("import genrec.serve.server, genrec.serve.worker, genrec.serve.engine, genrec.serve.failover, "
           "genrec.serve.cli, genrec.cli\n"
           "from genrec.serve.server import open_engine\n"
           # the CLI's own path: `genrec serve` with a config error exits 2 after its error handling
           "assert genrec.cli.main(['serve', '--serve.port=1']) == 2")


# ----- the repository -------------------------------------------------------------------------
def test_kernels_import_nothing_of_ours():
    assert layer_offenders(ROOT, "kernels", set()) == []


def test_embedding_imports_only_kernels():
    assert layer_offenders(ROOT, "embedding", {"kernels"}) == []


def test_models_are_single_process_code():
    assert layer_offenders(ROOT, "models", {"embedding", "kernels"}, {"torch.distributed", "grpc", "sglang"}) == []


def test_train_does_not_reach_up_into_serving():
    assert layer_offenders(ROOT, "train", None, {"genrec.serve", "genrec.quant", "genrec.proto", "genrec.benchmarks",
                                                 "grpc", "sglang"}) == []


def test_serving_loads_no_training_code():
    loaded = loaded_modules(SERVING)
    assert "genrec.serve.server" in loaded
    assert [m for m in loaded if _matches(m, {"genrec.train", "genrec.benchmarks", "sglang"})] == []


def test_the_load_generator_is_a_client():
    assert client_offenders(ROOT) == []
    assert load_generator_importers(ROOT) == []


def test_the_load_generator_loads_only_the_contract():
    # `genrec loadtest` as a user runs it: the command's handler, then what it imports
    loaded = loaded_modules("import genrec.loadtest.client\nfrom genrec.cli import _handler\n_handler('loadtest')")
    assert "genrec.loadtest.runner" in loaded and "genrec.proto.v1.recommender_pb2_grpc" in loaded
    assert [m for m in loaded if _matches(m, NOT_FOR_CLIENTS - {"genrec.cli"})] == []


def test_one_module_of_serve_imports_sglang():
    assert sglang_offenders(ROOT) == []


def test_serve_has_no_import_cycle():
    assert serve_cycles(ROOT) == []


def test_the_product_never_imports_benchmarks():
    assert benchmark_importers(ROOT) == []


def test_our_folders_are_imported_by_their_installed_names():
    assert bare_imports(ROOT) == []


# ----- each check on a tree that breaks it ----------------------------------------------------
BROKEN = {
    "kernels": ({"kernels/ops.py": "from genrec.models import hstu\n"},
                lambda r: layer_offenders(r, "kernels", set())),
    "kernels-config": ({"kernels/ops.py": "from genrec.config import from_dict\n"},
                       lambda r: layer_offenders(r, "kernels", set())),
    "embedding": ({"embedding/spec.py": "import genrec.train.data\n"},
                  lambda r: layer_offenders(r, "embedding", {"kernels"})),
    "models-layer": ({"models/hstu.py": "def f():\n    from genrec.serve import engine\n"},
                     lambda r: layer_offenders(r, "models", {"embedding", "kernels"})),
    "models-distributed": ({"models/hstu.py": "import torch.distributed as dist\n"},
                           lambda r: layer_offenders(r, "models", {"embedding", "kernels"}, {"torch.distributed"})),
    "train": ({"train/loop/trainer.py": "from genrec.quant.load import load_model\n"},
              lambda r: layer_offenders(r, "train", None, {"genrec.quant"})),
    "sglang-twice": ({"serve/sglang_runtime.py": "import sglang\n", "serve/sglang_models/genrec_tower.py": "import sglang\n",
                      "serve/other.py": "from sglang.srt import x\n"}, sglang_offenders),
    "sglang-front-end": ({"serve/sglang_runtime.py": "import sglang\n", "serve/sglang_engine.py": "import sglang\n",
                          "serve/sglang_models/genrec_tower.py": "import sglang\n"}, sglang_offenders),
    "sglang-none": ({"serve/sglang_runtime.py": "import torch\n",
                     "serve/sglang_models/genrec_tower.py": "import sglang\n"}, sglang_offenders),
    "sglang-eager": ({"serve/sglang_runtime.py": "import sglang as sgl\n",
                      "serve/sglang_models/genrec_tower.py": "import sglang\n",
                      "serve/server.py": "from genrec.serve.sglang_engine import SGLangEngine\n"}, sglang_offenders),
    "cycle": ({"serve/server.py": "from genrec.serve.worker import EngineProcess\n",
               "serve/worker.py": "def child():\n    from genrec.serve.server import make_engine\n"}, serve_cycles),
    "relative-cycle": ({"serve/a.py": "from . import b\n", "serve/b.py": "from .a import x\n"}, serve_cycles),
    "benchmarks": ({"genrec/cli.py": "from genrec.benchmarks.loadtest import cmd_loadtest\n"}, benchmark_importers),
    "bare": ({"tests/test_x.py": "from serve.server import ServeConfig\n"}, bare_imports),
    "client-train": ({"genrec/loadtest/workload.py": "def f():\n    from genrec.train.data.schema import read_info\n"},
                     client_offenders),
    "client-models": ({"genrec/loadtest/runner.py": "from genrec import models\n"}, client_offenders),
    "client-torch": ({"genrec/loadtest/report.py": "import torch\n"}, client_offenders),
    "server-imports-client": ({"serve/server.py": "from genrec.loadtest.client import user\n"},
                              load_generator_importers),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_check_fails_on_a_broken_tree(tmp_path, name):
    files, check = BROKEN[name]
    for folder in PACKAGES:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert check(tmp_path), f"the {name} check passed a tree that breaks it"


def test_the_serving_check_sees_training_code_when_it_is_loaded():
    loaded = loaded_modules("import genrec.serve.server, genrec.train.loop.checkpoint")
    assert [m for m in loaded if _matches(m, {"genrec.train"})]
