"""benchmarks/report.py: RESULTS.md is rendered from benchmarks/results/*.json and kept current."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from genrec.benchmarks import common, report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def test_every_result_file_has_a_section() -> None:
    page = report.render(RESULTS)
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        assert f"<!-- {path.stem}: results/{path.name} -->" in page
        assert "could not be rendered" not in page, path.name


def test_committed_page_is_current() -> None:
    committed = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert committed == report.render(RESULTS), (
        "benchmarks/RESULTS.md is stale: run `python -m genrec.benchmarks.report` and commit it")


def test_render_is_deterministic() -> None:
    assert report.render(RESULTS) == report.render(RESULTS)


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

    page = report.render(tmp_path)
    serving_part = page.split("<!-- serving: ")[1].split("<!-- ")[0]
    assert "| torch | 300 | missing | missing |" in serving_part
    assert "Machine: missing." in serving_part
    assert "missing" in page.split("<!-- quality: ")[1].split("<!-- ")[0]
    assert "Anchor: goal missing the naive step" in page
    assert "could not be rendered" not in page


def test_unknown_result_file_gets_a_generic_section(tmp_path: Path) -> None:
    (tmp_path / "newbench.json").write_text(json.dumps({"date": "2026-12-03", "qps": 12.5}))
    page = report.render(tmp_path)
    assert "## newbench" in page and "| qps | 12.5 |" in page


def test_check_flags_a_stale_page(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    assert report.main(["--out", str(out)]) == 0
    assert report.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "hand edit\n")
    assert report.main(["--check", "--out", str(out)]) == 1


def test_update_results_md_regenerates_the_page(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """What the benchmark scripts call after write_json: section and body are ignored, the page
    comes from the JSON files."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "kernels.json", results / "kernels.json")
    page = tmp_path / "RESULTS.md"
    page.write_text("# old hand-made page\n")
    monkeypatch.setattr(common, "RESULTS", results)
    monkeypatch.setattr(common, "RESULTS_MD", page)
    common.update_results_md()
    assert page.read_text() == report.render(results)
    assert "ignored body" not in page.read_text()
