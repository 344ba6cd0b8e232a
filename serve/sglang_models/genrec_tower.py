"""Registers genrec's tower with SGLang (see the package docstring)."""

from serve.sglang_engine import GenRecTower as EntryClass  # noqa: F401
