"""A model without GDN layers: the pass runs, changes nothing, and says so."""

import sys

import pytest

import gdn_pass
from gdn_pass.checker.demo import run_scenario

pytestmark = pytest.mark.slow


def test_llama_graph_unchanged_outputs_identical(engine_dir, llama_checkpoint):
    work = engine_dir / "llama"
    off = run_scenario("poisoned", "off", llama_checkpoint, work, python=sys.executable)
    on = run_scenario("poisoned", "on", llama_checkpoint, work, python=sys.executable)
    assert off["requests"].keys() == {"R1", "R2", "R3"}
    assert on["requests"] == off["requests"]

    reports = gdn_pass.load_reports(on["report_dir"])
    assert reports, "the pass did not run"
    for report in reports:
        assert report["graph_changed"] is False and report["guarded_per_op"] == {}
        # gathers the graph does have (embedding, logits rows) are reported as not state
        assert all(r["action"] == "not_state" for r in report["reads"]), report["reads"]
    assert "no GDN state reads" in open(on["log"]).read()
