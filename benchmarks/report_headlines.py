"""Which table of each benchmark's full section (DETAILS.md) heads its section of RESULTS.md,
cut to the rows and columns that matter most.

The headline is cut from the rendered section rather than computed again from the JSON, so
RESULTS.md and DETAILS.md cannot disagree and a renderer that lives beside its benchmark needs
no second function. A spec that no longer matches (a renamed column, a row that went away)
falls back to the whole table rather than to an empty one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Row = dict[str, str]  # header -> cell
MAX_ROWS = 8  # a headline longer than this is cut, the rest left to DETAILS.md


@dataclass(frozen=True)
class Headline:
    """The ``table``-th table of a section, its ``columns`` (by header, or by position where the
    header carries a figure of the JSON; all when empty) and the rows ``keep`` accepts."""

    table: int = 0
    columns: tuple[str | int, ...] = ()
    keep: Callable[[Row], bool] | None = field(default=None, compare=False)
    caption: str = ""  # what the cut shows, when the section's own subheading does not say it


def _is(column: str, *values: str) -> Callable[[Row], bool]:
    return lambda row: row.get(column) in values


def _not(column: str, *values: str) -> Callable[[Row], bool]:
    return lambda row: row.get(column) not in values


HEADLINES: dict[str, Headline] = {
    "quality": Headline(0, ("model", "HR@10", "NDCG@10", "HR@50", "date"),
                        _not("model", "popular baseline", "transition baseline")),
    "ranking": Headline(0, ("task", "joint AUC", "DLRM AUC", "oracle AUC", "joint calibration")),
    "quant": Headline(0, ("tables", "table bytes", "artifact bytes", "NDCG@10", "NDCG@10 loss", "meets goal"),
                      _is("dense", "fp32"), "fp32 dense layers:"),
    "serving": Headline(0, (0, 1, 2, 3), _is("server", "naive", "torch", "torch-padded", "torch-replicas2", "sglang")),
    "engine_capacity": Headline(0, ("engine ms for a batch of B", "1", "4", "8", "16")),
    "serving_scale": Headline(0, ("engine", "history", "p50 ms", "p99 ms")),
    "serving_cache": Headline(0, ("engine", "warm p50 ms (x torch)", "p50 / p99 ms by offered QPS (failures: inf)"),
                              _is("workload", "rank-8k"),
                              "Rank at 8,000 events (issue 44: p99 <= 30 ms at 20 QPS):"),
    "long_history": Headline(1, caption="Test split, read once:"),
    "long_quality": Headline(0, ("model", "resumed: HR@50", "last: NDCG@10 - full (paired)"),
                             _not("model", "full attention", "process, last 512"), caption="Validation:"),
    "long_ranking": Headline(0, ("model", "AUC: all", "AUC: resumed", "all - full"), caption="Click, validation:"),
    "sid_decoding": Headline(0, ("beam", "torch p50 / p99 ms", "SGLang p50 / p99 ms", "same items",
                                 "max abs dlogp", "items valid"), _is("call", "decode"),
                             "Decoding from a user vector:"),
    "ranking_serving": Headline(3, ("variant", "p50 ms", "floor ms", "x best"),
                                lambda r: r.get("history") == "4,096" and r.get("candidates") == "2,000",
                                "2,000 candidates, 4,096 cached events (x best: p50 / bf16 floor):"),
    "ranking_bounds": Headline(0, ("estimator", "click AUC, request 16", "conv. AUC, request 16"),
                               lambda r: r.get("estimator", "").startswith(("oracle", "knows every item vector; user from "
                                                                             "the history's topics and clicks"))),
    "ranking_curve": Headline(0, ("data", "click AUC: model / ceiling / oracle",
                                  "conversion AUC: model / ceiling / oracle")),
    "train_ops": Headline(0, keep=_is("figure", "accounting cost (A/B, interleaved rounds)",
                                      "loop's achieved / peak", "loop's MFU (its intervals)")),
    "data_reader": Headline(0, ("layout", "reader", "samples/s", "x the step's need", "rows decoded a sample")),
    "gate": Headline(0, ("run", "train_step_ms", "gate"), _not("run", *(f"unchanged commit, run {i}" for i in range(3, 9)))),
    "resilience": Headline(0, keep=lambda r: "(4x)" in r.get("offered QPS", ""), caption="At 4x capacity:"),
    "eval_protocol": Headline(0, ("data", "model", "HR@10 served", "former / served HR@10"),
                              _not("model", "popular baseline")),
    "ann_index": Headline(0, ("items", "search", "recall@100", "p50 ms", "x table"),
                          lambda r: "(chosen)" in r.get("search", "") or (r.get("search", "").startswith("exact")
                                                                          and r.get("items") == "10,000,000")),
    "serving_scale_ann_1m": Headline(0, ("engine", "p50 ms", "p99 ms", "recall@100")),
    "serving_scale_ann_10m": Headline(0, ("engine", "p50 ms", "p99 ms", "recall@100")),
}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(lines: list[str]) -> list[tuple[str, list[str]]]:
    """Every Markdown table of a section, each with the nearest ``###`` subheading before it."""
    found: list[tuple[str, list[str]]] = []
    sub, current = "", None
    for line in lines:
        if line.startswith("|"):
            if current is None:
                current = []
                found.append((sub, current))
            current.append(line)
            continue
        current = None
        if line.startswith("### "):
            sub = line[4:].strip()
    return found


def _cut(rows: list[list[str]], header: list[str], spec: Headline) -> tuple[list[int], list[list[str]]]:
    """The column positions and the rows of a table that ``spec`` keeps (all, where it keeps none)."""
    cols = [i for i, h in enumerate(header) if h in spec.columns or i in spec.columns]
    kept = [r for r in rows if spec.keep is None or spec.keep(dict(zip(header, r)))]
    return cols or list(range(len(header))), kept or rows


def headline(stem: str, lines: list[str]) -> list[str]:
    """The headline table of a section (its caption first, if any); [] when it has no table."""
    spec = HEADLINES.get(stem, Headline())
    found = tables(lines)
    if not found:
        return []
    sub, block = found[spec.table] if spec.table < len(found) else found[0]
    header = _cells(block[0])
    rows = [(_cells(line) + [""] * len(header))[:len(header)] for line in block[2:]]
    cols, kept = _cut(rows, header, spec)
    out = [f"{spec.caption or sub + ':'}", ""] if spec.caption or sub else []
    out += ["| " + " | ".join(header[i] for i in cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(r[i] for i in cols) + " |" for r in kept[:MAX_ROWS])]
    if len(kept) > MAX_ROWS:
        out += ["", f"({len(kept) - MAX_ROWS} more rows in the details.)"]
    return out
