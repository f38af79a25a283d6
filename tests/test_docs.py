"""Generated docs stay in step with what they are generated from."""

from pathlib import Path

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]


def test_performance_page_is_rendered_from_the_committed_records():
    records = sorted((ROOT / "docs" / "bench").glob("*.json"))
    assert records, "docs/bench/ holds no benchmark record"
    import json

    expected = report.render([json.loads(p.read_text()) for p in records])
    assert (ROOT / "docs" / "performance.md").read_text() == expected, (
        "docs/performance.md is out of date: run `python -m benchmarks.report docs/bench/*.json "
        "> docs/performance.md`"
    )
