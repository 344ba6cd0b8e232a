"""Registers genrec's tower with SGLang (see the package docstring)."""

from genrec.serve.sglang_engine import GenRecTower as EntryClass  # noqa: F401
