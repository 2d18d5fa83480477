"""``vllm serve`` users switch the fix on in JSON, and it works through the real server.

The server is vLLM's OpenAI-compatible API server on a loopback port, started
and stopped here, on the tiny Qwen3-Next with a tokenizer. A streaming HTTP
client drives the README scenario (``harness.serve_scenario``): R3
alone first (the reference), then, several times, R1 completes while R2
streams and R3 arrives on R1's recycled slot. Without the pass R3 diverges
from the reference (in at least one attempt: whether an attempt triggers the
bug depends on the server's step timing); with ``inductor_passes`` naming
``gdn_pass.vllm.serve.GDN_STATE_PASS`` it matches in every attempt, and R2 is
the same in both servers.
"""

import pytest

from gdn_pass.checker.demo import LOGPROB_TOL, compare
from harness.serve_scenario import run
from harness.tiny_checkpoints import write_checkpoint, write_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(engine_dir) -> dict:
    model = write_checkpoint("qwen3_next", engine_dir / "tiny_qwen3_next_served", seed=0)
    write_tokenizer(model, 1024)
    return {name: run(str(model), pass_by_name=by_name, workdir=engine_dir / "serve")
            for name, by_name in (("off", False), ("on", True))}


def test_reference_is_the_engine_reference(served, demo):
    # R3 alone on a fresh server = R3 alone in a fresh LLM engine.
    iso = demo["results"]["isolated"]["requests"]["R3"]
    for name in ("off", "on"):
        assert served[name]["requests"]["R3_isolated"]["tokens"] == iso["tokens"], name


def test_server_without_the_pass_serves_the_stale_state(served):
    off = served["off"]
    assert off["pass_reports"] == 0
    stale = [i for i, attempt in enumerate(off["attempts"])
             if not compare(off["requests"]["R3_isolated"], attempt["R3"])["same_tokens"]]
    assert stale, "no attempt read R1's recycled slot without the pass: the scenario did not trigger the bug"


def test_server_with_the_pass_by_name_matches_the_reference(served):
    on = served["on"]
    assert on["pass_reports"] >= 1, "the pass named in inductor_passes did not run in the server"
    for attempt in on["attempts"]:
        diff = compare(on["requests"]["R3_isolated"], attempt["R3"])
        assert diff["same_tokens"] and diff["max_logprob_diff"] <= LOGPROB_TOL, diff


def test_streamed_r2_unchanged_by_the_pass(served):
    diff = compare(served["off"]["requests"]["R2"], served["on"]["requests"]["R2"])
    assert diff["same_tokens"] and diff["max_logprob_diff"] == 0.0, diff
