"""gdn_pass.vllm.checker.scenarios.make_llm: the engine arguments it builds (no engine starts)."""

import pytest

import vllm
from gdn_pass.vllm.checker.scenarios import make_llm
from gdn_pass.vllm import VllmGDNStatePass
from gdn_pass.vllm.gdn_state_pass import SERVE_PASS


@pytest.fixture
def engine_kwargs(monkeypatch):
    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.update(kwargs) or kwargs)
    return seen


def test_a_callers_compilation_config_joins_the_pass_instead_of_replacing_it(engine_kwargs, qwen3_next_checkpoint):
    # engine_cost.py's first GPU run gave CUDA-graph sizes this way, and its
    # "gdn-pass" engine ran without the pass
    make_llm(str(qwen3_next_checkpoint), guard=True,
             compilation_config={"cudagraph_capture_sizes": [1, 2], "inductor_compile_config": {"dce": True}})
    cc = engine_kwargs["compilation_config"]
    assert cc["cudagraph_capture_sizes"] == [1, 2]
    assert cc["inductor_compile_config"]["dce"] is True
    assert isinstance(cc["inductor_compile_config"]["post_grad_custom_post_pass"], VllmGDNStatePass)


def test_pass_by_name_keeps_a_callers_compilation_config_too(engine_kwargs, qwen3_next_checkpoint):
    make_llm(str(qwen3_next_checkpoint), guard=True, pass_by_name=True,
             compilation_config={"cudagraph_capture_sizes": [4]})
    cc = engine_kwargs["compilation_config"]
    assert cc["cudagraph_capture_sizes"] == [4]
    assert cc["inductor_passes"] == {"post_grad_custom_post_pass": SERVE_PASS}


def test_unguarded_engine_gets_no_pass(engine_kwargs, qwen3_next_checkpoint):
    make_llm(str(qwen3_next_checkpoint), guard=False, compilation_config={"cudagraph_capture_sizes": [1]})
    assert engine_kwargs["compilation_config"] == {"cudagraph_capture_sizes": [1]}
