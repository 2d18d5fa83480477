"""Seeded scheduling fuzz on real vLLM (CI subset of benchmarks/fuzz_scheduling.py).

Two configurations: a stream that makes vLLM preempt and hit its prefix
cache in "align" mode, and bad input under load with prefix caching off
(aborts, prompts at max_model_len, no max_tokens, a burst larger than the
pool, on top of the plain trigger-rich stream). The plain "no_prefix_caching"
and "prefix_caching" streams are left to the benchmark: "bad_input_under_load"
contains the first, and on this checkpoint the second schedules exactly as
the first (384-token blocks, longer than its prompts).
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from harness import fuzz as fz
from harness.fuzz_judge import footprint_problem, fresh_reads, host_noise
from harness.tiny_checkpoints import write_checkpoint
from gdn_pass.vllm.checker.scenarios import R1_PROMPT, R3_PROMPT, R3_TOKENS

pytestmark = pytest.mark.slow


def test_zeroed_reference_engine_equals_a_fresh_engine(engine_dir, qwen3_next_checkpoint, demo):
    # R1 runs first and dirties its slot; R3 must then see a fresh engine's state.
    prompts = {json.dumps(R1_PROMPT): 4, json.dumps(R3_PROMPT): R3_TOKENS}
    spec = dict(role="reference", model=str(qwen3_next_checkpoint), guard=False,
                config="prefix_caching", prompts=prompts)
    ref = fz._run_engine(spec, engine_dir / "fuzz", "reference_check", sys.executable)["results"]
    fresh = demo["results"]["isolated"]["requests"]["R3"]
    got = ref[json.dumps(R3_PROMPT)]
    assert got["tokens"] == fresh["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], fresh["logprobs"])) <= 1e-4


def test_the_gdn_mtp_stream_has_room_for_several_requests():
    """The GDN MTP stream gets blocks for MTP_REQUESTS_AT_ONCE requests on every release (what they
    hold: test_mtp_blocks_admit_exactly_the_requests_asked); the other configurations keep 8."""
    settings = fz.engine_settings("mtp")
    k = settings["speculative_config"]["num_speculative_tokens"]
    assert settings["num_gpu_blocks_override"] == fz.mtp_blocks(k, fz.MTP_REQUESTS_AT_ONCE) > 8
    for config in ("bailing_linear_mtp", "no_prefix_caching"):
        assert fz.engine_settings(config)["num_gpu_blocks_override"] == 8


@pytest.mark.parametrize("release", ["0.30", "0.27", "0.32"])
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_blocks_admit_exactly_the_requests_asked(engine_dir, release_python, release, k):
    """vLLM's own scheduler, in a tiny MTP engine built on CPU and asked for one step, admits R1 and
    R2 at once with ``mtp_blocks(k, 2)`` blocks and only R1 with one block fewer: in the GPU family
    scenario R3 then runs beside R2 on R1's freed blocks, and no never-used block is left for it."""
    python = sys.executable if release == "0.30" else release_python(release)
    model = write_checkpoint("qwen3_next_mtp", engine_dir / "tiny_qwen3_next_mtp_admission", seed=0)
    blocks = fz.mtp_blocks(k, 2)
    admitted = {}
    for n in (blocks - 1, blocks):
        run = subprocess.run([python, str(Path(__file__).with_name("mtp_admission.py")), str(model), str(n),
                              str(k)], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith('{"admitted"')]
        assert run.returncode == 0 and lines, run.stderr[-3000:]
        result = json.loads(lines[-1])
        assert result["vllm"].startswith(release), result
        admitted[n] = result["admitted"]
    assert admitted == {blocks - 1: 1, blocks: 2}


def test_stream_is_seeded_and_hits_the_trigger_often():
    a, b = fz.make_stream(3, 50), fz.make_stream(3, 50)
    assert a == b and a != fz.make_stream(4, 50)
    assert sum(r.kind == "one_token" for r in a) >= 10
    assert {r.kind for r in a} >= {"one_token", "short", "long", "long_output"}


def test_bad_input_stream_has_every_kind_of_bad_input():
    stream = fz.make_stream(0, 200, bad_input=True, max_model_len=128)
    kinds = {r.kind for r in stream}
    assert kinds >= {"abort", "at_max_model_len", "no_max_tokens", "burst"}
    assert {len(r.prompt) for r in stream if r.kind == "at_max_model_len"} <= {127, 128, 129}
    assert all(r.abort_after is not None for r in stream if r.kind == "abort")
    bursts = [r.arrival_step for r in stream if r.kind == "burst"]
    assert max(bursts.count(s) for s in bursts) > fz.engine_settings("bad_input_under_load")["max_num_seqs"]


@pytest.fixture(scope="module")
def checkpoints(engine_dir, qwen3_next_checkpoint):
    small = write_checkpoint("qwen3_next_small_state", engine_dir / "tiny_qwen3_next_small_state", seed=0)
    return {"qwen3_next": qwen3_next_checkpoint, "qwen3_next_small_state": small}


@pytest.mark.parametrize("config", ["preempt_prefix_hits", "bad_input_under_load"])
def test_fuzz_finds_the_bug_without_the_pass_and_nothing_with_it(engine_dir, checkpoints, config):
    model = checkpoints[fz.CONFIG_CHECKPOINT.get(config, "qwen3_next")]
    # bad input also runs the pass with its guard broken on purpose: the fuzz must catch that;
    # the preemption stream's footprint is judged against the harness's own fix
    extra = {"bad_input_under_load": ("on+skip_zeroing",), "preempt_prefix_hits": (fz.HARNESS_FIX,)}[config]
    summary = fz.fuzz(model, engine_dir / "fuzz", seed=0, num_requests=40, guards=("off", "on", *extra),
                      config=config, python=sys.executable, progress=lambda m: None,
                      repeat_baseline_if_perturbed=True)
    off, on = summary["runs"]["off"], summary["runs"]["on"]
    assert on["fresh_decode_steps"] > 0
    assert off["mismatches"] > 0, "the fuzz must be able to fail: pass off reads stale state"
    assert off["first_token_mismatches"] > 0, "no stale first token with the pass off"
    assert on["mismatches"] == 0, on["examples"]
    assert summary["changed_by_pass_unexplained"] == [], "the pass changed requests it does not fix"
    assert_no_footprint(summary)
    # the rows the pass fixed are exactly rows vLLM's split put fresh on a decode path (row_paths)
    fixed = set(off["mismatched_ids"]) - set(on["mismatched_ids"])
    assert fixed <= set(fresh_reads({"traces": [on["trace"]]})), fixed
    # every step, the hook's count of rows to zero (host lengths) is the trace's (device lengths)
    assert on["trace"]["hook_compared_steps"] > 0
    assert on["trace"]["hook_disagreements"] == [], on["trace"]["hook_disagreements"][:2]
    if config == "preempt_prefix_hits":  # the paths this configuration exists for
        assert on["preemptions"] > 0 and on["resumed_after_preemption"] > 0
        assert on["resume_references"] > 0 and on["prefix_cache_hits"] > 0
        assert on["trace"]["rows"]["continuation"] > 0
    if config == "preempt_prefix_hits":  # the harness's fix is a fix: the reference's tokens
        assert summary["runs"][fz.HARNESS_FIX]["mismatches"] == 0
    if config == "bad_input_under_load":
        assert on["rejected"] > 0 and on["aborted"] > 0
        assert summary["runs"]["on+skip_zeroing"]["first_token_mismatches"] > 0, \
            "a pass whose guard zeroes nothing must fail the fuzz"


def assert_no_footprint(summary: dict) -> None:
    """The pass-on stream equals its footprint baseline bit for bit (``fuzz_judge.footprint_problem``)."""
    problem = footprint_problem(summary)
    assert problem is None, problem
    if host_noise(summary):
        warnings.warn(host_noise(summary))
