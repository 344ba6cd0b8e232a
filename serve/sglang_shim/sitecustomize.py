"""Runs at start-up of every Python process with this folder on PYTHONPATH (SGLang's
spawned workers): installs the hooks of ``serve.sglang_shim`` (see its docstring)."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("_genrec_sglang_shim", os.path.join(os.path.dirname(__file__), "__init__.py"))
if _spec is None or _spec.loader is None:
    raise ImportError("genrec's SGLang shim: its __init__.py is missing beside sitecustomize.py")
_shim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shim)
_shim.install()
