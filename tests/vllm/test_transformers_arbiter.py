"""benchmarks/transformers_arbiter.py: Transformers as a third engine for fuzz mismatches.

Its verdicts are only worth something if its model is vLLM's model: checked against
the README scenario's isolated run in a fresh vLLM engine (``demo``), token by token.
"""

import json

import pytest
import torch

from benchmarks.transformers_arbiter import TransformersModel, arbitrate, first_difference, side_of
from gdn_pass.vllm.checker.scenarios import R3_PROMPT


@pytest.fixture(scope="module")
def model():
    return TransformersModel("qwen3_next", seed=0)


def test_transformers_gives_the_isolated_runs_tokens(demo, model):
    """Greedy Transformers on the demo's checkpoint, fed vLLM's own prefix at each position, picks
    vLLM's token every time (vLLM's CPU engine, R3 alone in a fresh engine), with logprobs within
    0.15 (measured: 0.10 in float32, 0.20 in bfloat16, which the tool therefore does not default to)."""
    isolated = demo["results"]["isolated"]["requests"]["R3"]
    for i, (token, logprob) in enumerate(zip(isolated["tokens"], isolated["logprobs"])):
        lp = model.next_logprobs(R3_PROMPT + isolated["tokens"][:i])
        assert int(lp.argmax()) == token, (i, int(lp.argmax()), token)
        assert abs(float(lp[token]) - logprob) < 0.15, (i, float(lp[token]), logprob)


@pytest.mark.parametrize("position", [0, 1])
def test_a_reference_that_took_an_unlikely_token_is_the_wrong_side(demo, model, position):
    isolated = demo["results"]["isolated"]["requests"]["R3"]["tokens"]
    unlikely = int(model.next_logprobs(R3_PROMPT + isolated[:position]).argmin())  # far from any tie
    stream, reference = isolated[:position + 1], isolated[:position] + [unlikely]
    verdict = arbitrate(model, "R3", R3_PROMPT, stream, reference)
    assert (verdict.position, verdict.side, verdict.top_token) == (position, "stream", isolated[position])
    assert verdict.reference_rank > 100
    assert arbitrate(model, "R3", R3_PROMPT, reference, stream).side == "reference"
    assert arbitrate(model, "R3", R3_PROMPT, stream, stream) is None


@pytest.mark.parametrize("stream, reference, expected", [
    ([1, 2, 3], [1, 2, 4], 2),
    ([5], [6], 0),
    ([1, 2], [1, 2, 3], None),  # one a prefix of the other: they never part
    ([], [], None),
])
def test_first_difference(stream, reference, expected):
    assert first_difference(stream, reference) == expected


@pytest.mark.parametrize("values, expected", [
    ([-1.0, -3.0, -5.0], "stream"),      # stream's token (0) on top, reference's (1) 2 nats below
    ([-3.0, -1.0, -5.0], "reference"),
    ([-2.0, -2.05, -0.5], "near tie"),   # the two within the tie bound, whoever is on top
    ([-3.0, -4.0, -0.5], "neither"),     # a third token on top
])
def test_side_of(values, expected):
    assert side_of(torch.tensor(values), 0, 1, tie=0.1) == expected


def test_the_cases_of_a_fuzz_summary_are_its_kept_mismatches(tmp_path):
    from benchmarks.transformers_arbiter import _cases_from_summary

    kept = {"q38": dict(prompt=[1, 2], stream=[659, 3], reference=[355, 4])}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"mtp": {"runs": {"off": {"mismatched_outputs": kept}, "on": {}}}}))
    assert _cases_from_summary(str(path), "mtp", "off") == [("q38", [1, 2], [659, 3], [355, 4])]
    with pytest.raises(SystemExit, match="keeps no mismatched_outputs"):
        _cases_from_summary(str(path), "mtp", "on")
