"""Renders ``benchmarks/RESULTS.md`` and ``benchmarks/DETAILS.md`` from
``benchmarks/results/*.json``. RESULTS.md is one page: a line per benchmark at a glance, then
per benchmark its headline table, linking to its full section in DETAILS.md (every table and
paragraph, the anchors, the machine, the date and the command that produced it).

    python -m genrec.benchmarks.report            # rewrite both pages
    python -m genrec.benchmarks.report --check    # exit 1 if a page differs from the JSON

The pages are a pure function of the JSON files (sorted keys, fixed formats, no clock), so
``tests/test_report.py`` can check that the committed pages are current. A figure a JSON
lacks renders as ``missing``; a JSON with no renderer of its own gets a generic section.
Modules: ``report_format`` (figures, tables), ``report_sections`` and ``report_summaries``
(the sections this file renders itself), ``report_headlines`` (which table heads RESULTS.md).
How the figures came to be goes into ``benchmarks/notes/``, not here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genrec.benchmarks import report_sections as sec
from genrec.benchmarks import report_summaries as summ
from genrec.benchmarks.report_format import (
    MISSING,
    anchor_id,
    command,
    footer,
    get,
    machine_text,
    num,
    table,
)
from genrec.benchmarks.report_headlines import headline

# the renderers beside their benchmarks import these from here
__all__ = ["MISSING", "SECTIONS", "SUMMARIES", "anchor_id", "command", "footer", "get", "machine_text",
           "main", "num", "render", "renderer", "table", "write"]

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RESULTS_MD, DETAILS_MD = "RESULTS.md", "DETAILS.md"
SIZE_LIMIT = 15_000  # bytes of RESULTS.md: a page a person reads, not a log
SAME_CPU = "Compare speeds only between runs on the same CPU (the VM's varies)."


def _lazy(module: str, name: str) -> Callable[[dict], Any]:
    """A renderer that lives beside its benchmark (imported on use: it imports this module)."""

    def call(d: dict) -> Any:
        import importlib

        return getattr(importlib.import_module(f"genrec.benchmarks.{module}"), name)(d)

    return call


SUMMARIES: dict[str, Callable[[dict], tuple[str, str]]] = {
    "quality": summ.quality_summary, "train_speed": summ.train_speed_summary,
    "kernels": summ.kernels_summary, "ranking": summ.ranking_summary,
    "distributed": summ.distributed_summary, "quant": summ.quant_summary,
    "serving": summ.serving_summary, "engine_capacity": summ.engine_capacity_summary,
    "serving_scale": summ.serving_scale_summary, "resilience": summ.resilience_summary,
    "serving_cache": _lazy("serving_cache", "serving_cache_summary"),
    "long_history": _lazy("long_history", "long_history_summary"),
    "long_quality": _lazy("long_quality", "long_quality_summary"),
    "long_ranking": _lazy("long_ranking", "long_ranking_summary"),
    "sid_decoding": _lazy("sid_decoding", "sid_decoding_summary"),
    "sid_quality": _lazy("sid_quality", "sid_quality_summary"),
    "ranking_serving": _lazy("ranking_serving", "ranking_serving_summary"),
    "ranking_bounds": _lazy("ranking_bounds", "ranking_bounds_summary"),
    "train_ops": _lazy("train_ops", "train_ops_summary"),
    "ranking_curve": _lazy("ranking_curve", "ranking_curve_summary"),
    "data_reader": _lazy("data_reader", "data_reader_summary"),
    "gate": _lazy("gate_evidence", "gate_summary"),
    "eval_protocol": _lazy("eval_protocol", "eval_protocol_summary"),
    "fsdp_memory": _lazy("fsdp_memory", "fsdp_memory_summary"),
    "ann_index": _lazy("ann_index", "ann_index_summary"),
}


SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "quality": sec.quality, "train_speed": sec.train_speed, "kernels": sec.kernels,
    "ranking": sec.ranking, "distributed": sec.distributed, "quant": sec.quant,
    "serving": sec.serving, "engine_capacity": sec.engine_capacity,
    "serving_scale": sec.serving_scale, "resilience": sec.resilience,
    "serving_cache": _lazy("serving_cache", "serving_cache"), "long_history": _lazy("long_history", "long_history"),
    "long_quality": _lazy("long_quality", "long_quality"),
    "long_ranking": _lazy("long_ranking", "long_ranking"),
    "sid_decoding": _lazy("sid_decoding", "sid_decoding"),
    "sid_quality": _lazy("sid_quality", "sid_quality"),
    "ranking_serving": _lazy("ranking_serving", "ranking_serving"),
    "ranking_bounds": _lazy("ranking_bounds", "ranking_bounds"), "ranking_curve": _lazy("ranking_curve", "ranking_curve"),
    "train_ops": _lazy("train_ops", "train_ops"),
    "data_reader": _lazy("data_reader", "data_reader"),
    "gate": _lazy("gate_evidence", "gate"),
    "eval_protocol": _lazy("eval_protocol", "eval_protocol"),
    "fsdp_memory": _lazy("fsdp_memory", "fsdp_memory"),
    "ann_index": _lazy("ann_index", "ann_index"),
    "serving_scale_ann_1m": sec.serving_scale, "serving_scale_ann_10m": sec.serving_scale,
    "scale_10m_train": _lazy("scale_train", "scale_train_section"),
    "merged_10m": _lazy("merged_scale", "merged_scale_section"),
}
# results that extend another benchmark's section, on DETAILS.md only (as variants are)
DETAILS_ONLY = {"scale_10m_train", "merged_10m"}


def renderer(stem: str) -> Callable[[dict], list[str]] | None:
    """kernels_cuda.json renders like kernels.json, long_quality_dense.json like long_quality.json."""
    if stem in SECTIONS:
        return SECTIONS[stem]
    for family in ("kernels", "long_quality"):
        if stem.startswith(family + "_"):
            return SECTIONS[family]
    return None


# -- the pages --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Section:
    """One results file, rendered: its full section (``## title`` first) and its glance line."""

    path: Path
    lines: list[str]
    head: str
    anchor: str
    date: str

    @property
    def id(self) -> str:
        return anchor_id(self.lines[0])


def section(path: Path) -> Section:
    """The section of one results file; a malformed file gets a section that says so."""
    data = json.loads(path.read_text())
    fn = renderer(path.stem)
    summary = SUMMARIES.get(path.stem) or (summ.kernels_summary if fn is sec.kernels else None)
    try:
        body = fn(data) if fn else sec.generic(path.stem, data)
        head, anchor = summary(data) if summary else ("see below", "none recorded")
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a malformed file keeps the page
        body = [f"## {path.stem}", "", f"`{path.name}` could not be rendered ({type(e).__name__}: {e}); "
                "figures missing."]
        head, anchor = MISSING, MISSING
    date = data.get("date") if isinstance(data, dict) else None
    if date is None and isinstance(data, dict) and data.get("records"):
        date = max(str(r.get("date", "")) for r in data["records"] if isinstance(r, dict))
    return Section(path, body, head, anchor, str(date or MISSING))


def sections(results: Path) -> list[Section]:
    """Every ``*.json`` under ``results``, in a fixed order: SECTIONS's, then by name."""
    order = list(SECTIONS)
    files = sorted(results.glob("*.json"), key=lambda p: (order.index(p.stem) if p.stem in order
                                                          else len(order), p.stem))
    return [section(p) for p in files]


def variant(stem: str) -> bool:
    """Whether ``stem`` is a variant run of another benchmark, rendered as it is
    (``serving_scale_ann_1m`` of ``serving_scale``): those are on DETAILS.md only, so that
    RESULTS.md stays one page."""
    return stem in DETAILS_ONLY or any(stem.startswith(other + "_") and renderer(stem) is fn
                                       for other, fn in SECTIONS.items())


def target(stem: str) -> str:
    """The link target put above a benchmark's heading on both pages: its results file's stem,
    short and stable where the heading's own id is long and changes with its title."""
    return f'<a id="{stem}"></a>'


def results_page(secs: list[Section]) -> str:
    """RESULTS.md: the line per benchmark, then each benchmark's headline table (variant runs:
    DETAILS.md only)."""
    secs = [s for s in secs if not variant(s.path.stem)]
    glance = [[f"[{s.path.stem}](#{s.path.stem})", s.head, s.anchor] for s in secs]
    out = ["# Benchmark results", "",
           "Generated by `python -m genrec.benchmarks.report` from `benchmarks/results/*.json`: a "
           f"headline table per benchmark; all figures with their anchor, machine, date and command in "
           f"[{DETAILS_MD}]({DETAILS_MD}). {SAME_CPU} History: `benchmarks/notes/`.",
           "", "## At a glance", "", *table(["benchmark", "headline", "anchor"], glance)]
    for s in secs:
        top = headline(s.path.stem, s.lines)
        out += ["", target(s.path.stem), s.lines[0], "", *top, *([""] if top else []),
                f"[Details]({DETAILS_MD}#{s.path.stem})"]
    return "\n".join(out) + "\n"


def details_page(secs: list[Section]) -> str:
    """DETAILS.md: every benchmark's full section."""
    out = ["# Benchmark results in full", "",
           "Generated by `python -m genrec.benchmarks.report` from `benchmarks/results/*.json`; do not "
           f"edit by hand. The one-page summary: [{RESULTS_MD}]({RESULTS_MD}). Every section gives its "
           f"figures beside their anchor, the machine, the date and the command. {SAME_CPU}"]
    for s in secs:
        out += ["", f"<!-- {s.path.stem}: results/{s.path.name} -->", target(s.path.stem), *s.lines]
    return "\n".join(out) + "\n"


def render(results: Path = RESULTS) -> dict[str, str]:
    """Both pages for every ``*.json`` under ``results``: {file name: text}."""
    secs = sections(results)
    return {RESULTS_MD: results_page(secs), DETAILS_MD: details_page(secs)}


def write(results: Path = RESULTS, out: Path = HERE) -> list[str]:
    """Rewrites the pages under ``out``; the names of those that changed."""
    changed = []
    for name, text in render(results).items():
        page = out / name
        if not page.exists() or page.read_text() != text:
            page.write_text(text)
            changed.append(name)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is not the rendered one")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of *.json (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=HERE, help=f"folder of {RESULTS_MD} and {DETAILS_MD} "
                    "(default: %(default)s)")
    args = ap.parse_args(argv)
    if args.check:
        pages = render(args.results)
        stale = [n for n, text in pages.items() if not (args.out / n).exists() or (args.out / n).read_text() != text]
        print(f"{', '.join(stale)} stale: run python -m genrec.benchmarks.report" if stale else "pages current")
        return int(bool(stale))
    changed = write(args.results, args.out)
    print(f"{args.out}: {', '.join(changed) + ' rewritten' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
