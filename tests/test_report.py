"""benchmarks/report.py: RESULTS.md (one page) and DETAILS.md (every figure) are rendered from
benchmarks/results/*.json and kept current."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from genrec.benchmarks import common, report, report_headlines
from genrec.benchmarks.report_headlines import Headline, headline

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return report.render(RESULTS)


def heading_ids(page: str) -> set[str]:
    """The ids GitHub gives a page's headings (a repeated one gets -1, -2, ...) and its
    explicit link targets (``<a id="...">``)."""
    ids: set[str] = set()
    count: dict[str, int] = {}
    for line in page.splitlines():
        if line.startswith('<a id="'):
            ids.add(line.split('"')[1])
        if line.startswith("#"):
            base = report.anchor_id(line)
            n = count.get(base, 0)
            count[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def sections(page: str) -> dict[str, str]:
    """A page's ``## `` sections by heading, the text before the first left out."""
    parts = page.split("\n## ")[1:]
    return {p.split("\n", 1)[0]: p for p in parts}


def test_every_result_file_has_a_section(pages: dict[str, str]) -> None:
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        assert f"<!-- {path.stem}: results/{path.name} -->" in pages["DETAILS.md"]
        assert f"| [{path.stem}](#" in pages["RESULTS.md"] or report.variant(path.stem)
    for page in pages.values():
        assert "could not be rendered" not in page


def test_committed_pages_are_current(pages: dict[str, str]) -> None:
    for name, text in pages.items():
        committed = (ROOT / "benchmarks" / name).read_text()
        assert committed == text, (
            f"benchmarks/{name} is stale: run `python -m genrec.benchmarks.report` and commit it")


def test_render_is_deterministic(pages: dict[str, str]) -> None:
    assert report.render(RESULTS) == pages


def test_results_page_is_one_page(pages: dict[str, str]) -> None:
    page = pages["RESULTS.md"]
    assert len(page.encode()) < report.SIZE_LIMIT
    secs = sections(page)
    assert secs.pop("At a glance").count("\n|---") == 1
    # every result but variant runs (DETAILS.md only: report.variant)
    assert len(secs) == len([p for p in RESULTS.glob("*.json") if not report.variant(p.stem)])
    for title, text in secs.items():
        assert text.count("\n|---") <= 1, f"RESULTS.md, {title}: more than one table"


def test_every_section_links_to_its_details(pages: dict[str, str]) -> None:
    details_ids, results_ids = heading_ids(pages["DETAILS.md"]), heading_ids(pages["RESULTS.md"])
    secs = sections(pages["RESULTS.md"])
    del secs["At a glance"]
    for title, text in secs.items():
        link = text.split("](DETAILS.md#")[1].split(")")[0]
        assert link in details_ids, f"RESULTS.md, {title}: no link to its DETAILS.md section"
        assert f'<a id="{link}"></a>\n## {title}\n' in pages["DETAILS.md"]
    for line in pages["RESULTS.md"].split("## At a glance")[1].split("\n\n")[1].splitlines()[2:]:
        assert line.split("](#")[1].split(")")[0] in results_ids, line


def test_headline_keeps_the_whole_table_when_its_spec_no_longer_matches(monkeypatch) -> None:  # noqa: ANN001
    lines = ["## t", "", "### ml1m", "", "| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]
    assert headline("new", lines) == ["ml1m:", "", *lines[4:]]
    monkeypatch.setitem(report_headlines.HEADLINES, "new", Headline(0, ("renamed",), lambda r: r["a"] == "9"))
    assert headline("new", lines) == ["ml1m:", "", *lines[4:]]
    monkeypatch.setitem(report_headlines.HEADLINES, "new", Headline(0, ("b",), lambda r: r["a"] == "3"))
    assert headline("new", lines) == ["ml1m:", "", "| b |", "|---|", "| 4 |"]
    assert headline("new", ["## t", "", "no table"]) == []


def test_missing_figures_render_as_missing(tmp_path: Path) -> None:
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    serving = json.loads((tmp_path / "serving.json").read_text())
    del serving["engines"]["torch"]["single_request"]
    del serving["machine"]
    (tmp_path / "serving.json").write_text(json.dumps(serving))
    quality = json.loads((tmp_path / "quality.json").read_text())
    del quality["records"][0]["ndcg@10"]
    (tmp_path / "quality.json").write_text(json.dumps(quality))
    (tmp_path / "train_speed.json").write_text(json.dumps({"date": "2026-12-03"}))

    pages = report.render(tmp_path)
    page = pages["DETAILS.md"]
    serving_part = page.split("<!-- serving: ")[1].split("<!-- ")[0]
    assert "| torch | 300 | missing | missing |" in serving_part
    assert "Machine: missing." in serving_part
    assert "missing" in page.split("<!-- quality: ")[1].split("<!-- ")[0]
    assert "Anchor: goal missing the naive step" in page
    assert "| torch | 300 | missing | missing |" in pages["RESULTS.md"]
    assert all("could not be rendered" not in p for p in pages.values())


def test_unknown_result_file_gets_a_generic_section(tmp_path: Path) -> None:
    (tmp_path / "newbench.json").write_text(json.dumps({"date": "2026-12-03", "qps": 12.5}))
    for page in report.render(tmp_path).values():
        assert "## newbench" in page and "| qps | 12.5 |" in page


def test_check_flags_a_stale_page(tmp_path: Path) -> None:
    assert report.main(["--out", str(tmp_path)]) == 0
    assert report.main(["--check", "--out", str(tmp_path)]) == 0
    for name in ("RESULTS.md", "DETAILS.md"):
        page = tmp_path / name
        text = page.read_text()
        page.write_text(text + "hand edit\n")
        assert report.main(["--check", "--out", str(tmp_path)]) == 1
        page.write_text(text)


def test_update_results_md_regenerates_both_pages(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """What the benchmark scripts call after write_json: the pages come from the JSON files."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "kernels.json", results / "kernels.json")
    (tmp_path / "RESULTS.md").write_text("# old hand-made page\n")
    monkeypatch.setattr(common, "RESULTS", results)
    monkeypatch.setattr(common, "RESULTS_MD", tmp_path / "RESULTS.md")
    common.update_results_md()
    for name, text in report.render(results).items():
        assert (tmp_path / name).read_text() == text


def test_a_result_records_the_command_it_was_run_with(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """resilience recorded no command, so its page quoted a default without the --workload the
    run was given, and the figures could not be reproduced from it: write_json records how the
    benchmark was started unless the payload names a command itself."""
    import json
    import sys
    from types import SimpleNamespace

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=SimpleNamespace(name="genrec.benchmarks.resilience")))
    monkeypatch.setattr(sys, "argv", ["resilience.py", "--artifact", "runs/a b", "--workload", "wl.jsonl"])
    common.write_json("resilience", {"servers": {}})
    assert json.loads((tmp_path / "resilience.json").read_text())["command"] == (
        "python -m genrec.benchmarks.resilience --artifact 'runs/a b' --workload wl.jsonl")
    common.write_json("own", {"command": "python -m genrec.benchmarks.own --x 1"})
    assert json.loads((tmp_path / "own.json").read_text())["command"] == "python -m genrec.benchmarks.own --x 1"


def test_a_resilience_step_whose_sender_ran_late_is_marked_generator_bound() -> None:
    """A 4x step the one-core generator could not send on time measured the generator as much
    as the server: its headline says so (benchmarks/notes/2026-12-05-resilience-generator.md)."""
    from genrec.benchmarks.report_summaries import resilience_summary

    def at4(late_ms: float) -> str:
        run = {"multiple": 4, "goodput": 200.0, "send_late_p99_ms": late_ms}
        return resilience_summary({"capacity_qps": 400.0, "servers": {"default": {"overload": [run]}}})[0]

    assert "generator-bound" in at4(201.0) and "0.50x" in at4(201.0)
    assert "generator-bound" not in at4(3.0)
    both = resilience_summary({"capacity_qps": 400.0, "servers": {
        "default": {"overload": [{"multiple": 4, "goodput": 200.0}]},
        "native front-end": {"overload": [{"multiple": 4, "goodput": 360.0}]}}})[0]
    assert "default 0.50x, native front-end 0.90x" in both
    own = resilience_summary({"capacity_qps": 400.0, "servers": {  # a server's own capacity, where measured
        "native front-end": {"capacity_qps": 500.0, "overload": [{"multiple": 4, "goodput": 450.0}]}}})[0]
    assert "native front-end 0.90x" in own


def test_every_benchmark_with_a_main_runs_as_a_module() -> None:
    """The pages tell readers to run ``python -m genrec.benchmarks.<name>``: a benchmark that
    defines ``main`` must call it when run so (long_quality once lost its guard and exited 0
    doing nothing)."""
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        if "\ndef main(" in text:
            assert 'if __name__ == "__main__":' in text.split("\ndef main(")[1], f"{path.name}: main() is never run"


def test_an_engine_kill_that_failed_no_call_says_so() -> None:
    """The section read "the last missing s after the kill" when no call failed (2026-12-06)."""
    from genrec.benchmarks.report_sections import resilience

    def text(kill: dict) -> str:
        return "\n".join(resilience({"capacity_qps": 400.0, "servers": {}, "engine_kill": kill, "shutdown": {}}))

    none = text({"offered_qps": 200.0, "sent": 5460, "failed": 0, "failed_pct": 0.0,
                 "last_failure_after_kill_s": None})
    assert "(none of 5,460)" in none and "missing" not in none.split("SIGTERM")[0]
    some = text({"offered_qps": 200.0, "sent": 100, "failed": 2, "failed_pct": 2.0, "last_failure_after_kill_s": 0.3})
    assert "the last 0.3 s after the kill" in some
