"""Registers genrec's HSTU model with SGLang (see the package docstring)."""

from genrec.serve.sglang_engine import GenRecHSTU as EntryClass  # noqa: F401
