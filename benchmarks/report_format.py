"""Formatting shared by every section renderer of the results pages (``report.py`` and the
renderers that live beside their benchmarks): figures, tables, machines, commands, anchors.
Pure functions of their arguments, so the pages are a pure function of the JSON files."""

from __future__ import annotations

import math
from typing import Any

MISSING = "missing"


def get(d: Any, path: str) -> Any:
    """``d["a"]["b"]`` for path "a.b"; None where any step is absent."""
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def num(x: Any, fmt: str = ".4f", suffix: str = "") -> str:
    """A figure, or ``missing``; inf and nan spelled out."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return MISSING if x is None else str(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf"
    return f"{x:{fmt}}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table: the header, the separator, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def machine_text(m: Any) -> str:
    if not isinstance(m, dict):
        return MISSING
    parts = [str(m.get("cpu", MISSING)), f"{num(m.get('cores'), 'd')} cores"]
    if m.get("cores_usable") is not None and m.get("cores_usable") != m.get("cores"):
        parts[-1] += f" ({num(m['cores_usable'], 'd')} usable)"
    parts.append(f"torch threads {num(m.get('threads'), 'd')}")
    parts.append(f"GPU {m['gpu']}" if m.get("gpu") else "no GPU")
    parts.append(f"torch {m.get('torch', MISSING)}")
    return ", ".join(parts)


def command(d: dict, default: str) -> str:
    """The recorded command (renamed to the installed package's module path), else the default."""
    cmd = d.get("command") if isinstance(d, dict) else None
    if not cmd:
        return default
    return cmd.replace("python -m benchmarks.", "python -m genrec.benchmarks.")


def footer(d: dict, cmd: str) -> list[str]:
    return ["", f"Machine: {machine_text(d.get('machine'))}. Date: {d.get('date', MISSING)}. "
            f"Command: `{cmd}`."]


def anchor_id(heading: str) -> str:
    """GitHub's id of a Markdown heading: lower case, punctuation dropped, spaces as '-'."""
    text = heading.lstrip("#").strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")
