"""Seeded scheduling fuzz on real vLLM (CI subset of benchmarks/fuzz_scheduling.py)."""

import json
import sys

import pytest

from gdn_pass.examples import fuzz as fz
from gdn_pass.examples.vllm_scenarios import R1_PROMPT, R3_PROMPT, R3_TOKENS

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


def test_stream_is_seeded_and_hits_the_trigger_often():
    a, b = fz.make_stream(3, 50), fz.make_stream(3, 50)
    assert a == b and a != fz.make_stream(4, 50)
    assert sum(r.kind == "one_token" for r in a) >= 10
    assert {r.kind for r in a} >= {"one_token", "short", "long", "long_output"}


# "preempt_prefix_hits" is not in CI yet: with the pass on it still shows
# mismatches whose cause is open (issue 13; benchmarks/results/fuzz_preemption_probe.md).
@pytest.mark.parametrize("config", ["no_prefix_caching", "prefix_caching"])
def test_fuzz_finds_the_bug_without_the_pass_and_nothing_with_it(engine_dir, qwen3_next_checkpoint,
                                                                   config):
    summary = fz.fuzz(qwen3_next_checkpoint, engine_dir / "fuzz", seed=0, num_requests=40,
                      config=config, python=sys.executable, progress=lambda m: None)
    off, on = summary["runs"]["off"], summary["runs"]["on"]
    assert on["fresh_decode_steps"] > 0
    assert off["mismatches"] > 0, "the fuzz must be able to fail: pass off reads stale state"
    assert on["mismatches"] == 0, on["examples"]
