"""The gdn-pass command line on the bundled torch-native model (no vLLM needed)."""

import subprocess
import sys

from gdn_pass.cli import main


def test_check_torch_gdn(capsys):
    assert main(["check", "torch-gdn"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.startswith(("fresh", "padding"))}
    assert rows["fresh-one-token-next-to-decodes"] == ["FAIL", "PASS"]
    assert rows["fresh-chunked-prefill"] == ["FAIL", "PASS"]
    # -1 wraps to the last, live slot without the guard; 0 is the null slot
    assert rows["padding-rows-sentinel-minus-1"] == ["FAIL", "PASS"]
    assert rows["padding-rows-sentinel-0"][1] == "PASS"
    assert "RESULT: every scenario passes with the pass on" in out


def test_report_torch_gdn(capsys):
    assert main(["report", "torch-gdn"]) == 0
    out = capsys.readouterr().out
    assert "guarded 2 state read(s) (aten.index.Tensor x2)" in out
    assert out.count("[guarded_gather]") == 2


def test_dump_torch_gdn(tmp_path, capsys):
    assert main(["dump", "torch-gdn", "--out", str(tmp_path)]) == 0
    assert list((tmp_path / "pass_on").glob("*gdn_pass_before*.py"))
    after = list((tmp_path / "pass_on").glob("*gdn_pass_after*.py"))
    assert after and "gated_gather" in after[0].read_text()
    assert not list((tmp_path / "pass_off").glob("*gdn_pass_*.py"))
    assert list(tmp_path.rglob("*kernel*.py"))
    assert list((tmp_path / "reports").glob("report_*.json"))


def test_unknown_model_says_what_to_do(capsys):
    assert main(["report", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "tiny-qwen3-next" in err


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "gdn_pass", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "report" in proc.stdout and "check" in proc.stdout


def test_report_of_an_engine_whose_own_fix_holds_says_so(tmp_path, capsys):
    """vLLM 0.31+ GDN: the pass found the core op and stood down; not "no GDN layer found"."""
    from gdn_pass.cli import _print_vllm_reports
    from gdn_pass.report import PassReport, StateRead

    read = StateRead(node="core", kind="opaque_op", op="vllm::gdn_attention_core", layer="model.layers.0.linear_attn",
                     action="not_needed", reason="not needed: vLLM routes fresh rows to its prefill path")
    PassReport(pass_name="VllmGDNStatePass", pass_uuid="0" * 16, options={}, num_nodes=8, analyses=[],
               reads=[read]).write(tmp_path)
    assert _print_vllm_reports(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "1 not needed" in out and "UNGUARDED" not in out
    assert "this vLLM's own fix holds there" in out and "no GDN layer found" not in out
