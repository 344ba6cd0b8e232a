"""Imports point one way (ENGINEERING.md): kernels <- embedding <- models <- train / quant / serve."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"kernels", "embedding", "models", "train", "quant", "serve", "proto", "genrec", "benchmarks"}


def imports(package):
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                n = n.removeprefix("genrec.") if n.split(".")[1:2] and n.split(".")[1] in OURS else n
                found.setdefault(n, set()).add(path.relative_to(ROOT).as_posix())
    return found


def offenders(package, forbidden):
    return {m: f for m, f in imports(package).items() if any(m == x or m.startswith(x + ".") for x in forbidden)}


def test_kernels_import_nothing_of_ours():
    assert offenders("kernels", OURS - {"kernels"}) == {}


def test_embedding_imports_only_kernels():
    assert offenders("embedding", OURS - {"embedding", "kernels"}) == {}


def test_models_are_single_process_code():
    assert offenders("models", OURS - {"models", "embedding", "kernels"}) == {}
    assert offenders("models", {"torch.distributed", "grpc", "sglang"}) == {}


def test_train_does_not_reach_up_into_serving():
    assert offenders("train", {"serve", "quant", "proto", "grpc", "sglang"}) == {}
