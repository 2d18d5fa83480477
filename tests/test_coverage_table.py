"""The README's coverage table is the rendering of the recorded test results."""

import json
from pathlib import Path

from harness.coverage import BEGIN, END, render

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_is_rendered_from_recorded_results():
    recorded = json.loads((ROOT / "benchmarks/results/coverage.json").read_text())
    readme = (ROOT / "README.md").read_text()
    table = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == render(recorded).strip(), (
        "README coverage table is stale: python -m harness.coverage "
        "benchmarks/results/coverage.json --readme README.md")


def test_render_marks_a_family_that_was_not_fixed():
    table = render({"fam": {"mode": {"CPU": {"status": "e2e", "reproduced": True, "fixed": False}}}})
    assert "NOT FIXED" in table


def test_render_notes_a_fix_judged_by_the_clean_engine():
    cell = {"status": "e2e", "reproduced": True, "fixed": True, "max_logprob_diff": 0.0774, "r3_on_equals_clean": True}
    table = render({"fam": {"mtp": {"GPU": cell}}})
    assert "| fixed e2e [1] |" in table and "0.077 from that run" in table and "never-used slot" in table
    exact = render({"fam": {"mtp": {"GPU": {**cell, "max_logprob_diff": 0.0}}}})
    assert "| fixed e2e |" in exact and "[1]" not in exact
