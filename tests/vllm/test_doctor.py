"""``gdn-pass doctor``: the decisions an engine would make, printed, for this release (and 0.27, 0.31, 0.32
through ``test_releases.py``).

The reference is the releases' known facts, not the code under test: the
GDN builder has the bug before 0.31 and reroutes fresh rows from 0.31
(vllm#51565); the Lightning builders have it on every release. On CPU no
FULL CUDA graph replays a step, so where vLLM reroutes the entry stands down.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gdn_pass.vllm import compat

BUILT_IN_FIX = compat.version_tuple() >= (0, 31)


def doctor(*args: str) -> tuple[int, str]:
    run = subprocess.run([sys.executable, "-m", "gdn_pass", "doctor", *args], capture_output=True, text=True,
                         timeout=300)
    return run.returncode, run.stdout


@pytest.fixture(scope="module")
def as_json(qwen3_next_checkpoint) -> dict:
    """With a model: every builder can be made (vLLM 0.32's GDN builder reads the model's config)."""
    code, out = doctor(str(qwen3_next_checkpoint), "--json")
    assert code == 0, out
    return {row["entry"]: row for row in json.loads(out)["builders"]}


def test_the_decision_for_each_builder_follows_what_its_release_does(as_json):
    assert as_json["gdn"]["action"] == ("stands down" if BUILT_IN_FIX else "acts"), as_json["gdn"]
    assert as_json["bailing_linear"]["action"] == "acts"
    assert as_json["minimax_linear"]["action"] == "acts"
    split = next(c for c in as_json["bailing_linear"]["checks"] if c["name"] == "split")
    assert split["passed"] and split["found"].startswith("fresh one-token row -> decode")


def test_the_printed_table_names_each_builder_and_the_line_to_enable_it():
    code, out = doctor()  # no model: a builder that needs one says so
    assert code == 0, out
    gdn_line = next(line for line in out.splitlines() if line.startswith("gdn "))
    assert gdn_line.split()[-1] in ("acts", "down", "MODEL"), gdn_line
    assert f"gdn-pass doctor: vLLM {compat.vllm_version()} (tested)" in out
    for name in ("GDNAttentionMetadataBuilder", "BailingLinearAttentionMetadataBuilder",
                 "LinearAttentionMetadataBuilder"):
        assert name in out
    assert '"post_grad_custom_post_pass": gdn_pass.vllm.VllmGDNStatePass()' in out
    assert "gdn_pass.vllm.serve.GDN_STATE_PASS" in out


def test_with_a_model_it_says_which_builders_the_model_uses(qwen3_next_checkpoint, llama_checkpoint):
    code, out = doctor(str(qwen3_next_checkpoint), "--json")
    assert code == 0, out
    result = json.loads(out)
    used = {row["entry"]: row["used_by_model"] for row in result["builders"]}
    assert used["gdn"] is True and used["bailing_linear"] is False
    assert result["model_architectures"] == ["Qwen3NextForCausalLM"]
    code, out = doctor(str(llama_checkpoint))
    assert code == 0 and "none that gdn-pass knows (nothing to guard)" in out, out


def test_a_model_path_without_a_config_is_a_clear_error(tmp_path):
    run = subprocess.run([sys.executable, "-m", "gdn_pass", "doctor", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0
    assert "has no config.json; give a model folder" in run.stderr + run.stdout
