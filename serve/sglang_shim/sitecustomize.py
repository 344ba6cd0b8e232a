"""Runs at start-up of the Python processes SGLang spawns while this folder is on PYTHONPATH
(``serve.sglang_runtime`` puts it there around an engine's start only): installs the hooks of
``serve.sglang_shim`` (see its docstring), then runs the ``sitecustomize`` this one shadows,
if the site has one, so the site's own start-up code still runs."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_genrec_sglang_shim", os.path.join(_here, "__init__.py"))
if _spec is None or _spec.loader is None:
    raise ImportError("genrec's SGLang shim: its __init__.py is missing beside sitecustomize.py")
_shim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shim)
_shim.install()

_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_site = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _site is not None and _site.loader is not None:
    _mod = importlib.util.module_from_spec(_site)
    _site.loader.exec_module(_mod)
