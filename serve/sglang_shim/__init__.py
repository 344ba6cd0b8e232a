"""Import-time shims that let SGLang 0.5.23 start on a CPU without its CUDA-only packages.

Two facts of this environment (see ../shared/notes/sglang.md), each fixed without touching
site-packages and only when needed:

* SGLang imports ``torchvision`` at start-up; the only torchvision wheels available are CUDA
  builds whose fake-op registration for ``torchvision::nms`` / ``qnms`` fails on CPU torch
  ("operator torchvision::nms does not exist"). The hook declares those two op schemas just
  before torchvision's first import, and only if they are missing.
* With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports names from ``sgl_kernel`` that serve
  speculative decoding and KV-cache moves (never called on our paths); there is no CPU build
  of sgl-kernel on the package index. ``sgl_kernel_cpu_stub`` provides the names, each
  raising NotImplementedError, and is found only when no real ``sgl_kernel`` is.

``install()`` puts both hooks on ``sys.meta_path`` in this process; ``sitecustomize.py`` in
this folder does the same in SGLang's spawned workers (this folder goes on PYTHONPATH).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class TorchvisionOpSchemaHook(importlib.abc.MetaPathFinder):
    """One-shot: before torchvision is imported, declare nms/qnms if torch lacks them."""

    library = None  # keeps the registration alive

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if not hasattr(torch.ops.torchvision, "nms"):
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            TorchvisionOpSchemaHook.library = lib
        return None  # the normal finders import torchvision itself


class SglKernelCpuStubFinder(importlib.abc.MetaPathFinder):
    """Resolves ``sgl_kernel`` to the import-only stub, on the CPU engine only, and last."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname != "sgl_kernel" or os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
            return None
        return importlib.util.spec_from_file_location(
            "sgl_kernel", os.path.join(HERE, "sgl_kernel_cpu_stub", "__init__.py"))


def install() -> None:
    if not any(isinstance(f, TorchvisionOpSchemaHook) for f in sys.meta_path) and "torchvision" not in sys.modules:
        sys.meta_path.insert(0, TorchvisionOpSchemaHook())
    if not any(isinstance(f, SglKernelCpuStubFinder) for f in sys.meta_path):
        sys.meta_path.append(SglKernelCpuStubFinder())  # after the real finders: a real package wins
