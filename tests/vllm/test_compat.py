"""The vLLM adapter against the vLLM installed here (every CPU release, and 0.26 on the GPU).

The schemas are read from the ops this vLLM registers, never restated from
``compat.CORE_OPS``: a release that renamed an argument fails here.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import vllm
from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS
from gdn_pass.vllm import builders, compat
from gdn_pass.vllm.guarded_ops import guarded_overload

# Modules that register vLLM's GDN/KDA core ops, by release.
_OP_MODULES = (
    "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
    "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn",
    "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn",
    "vllm.model_executor.models.bailing_moe_v3",
    "vllm.model_executor.layers.mamba.linear.minimax_linear_attn",
)
VERSION = tuple(int(p) for p in vllm.__version__.split(".")[:2])


def _in_releases(releases: str) -> bool:
    first, _, last = releases.partition("-")
    low = tuple(int(p) for p in first.split("."))
    high = tuple(int(p) for p in (last or first).split("."))
    return low <= VERSION <= high


@pytest.fixture
def registered_ops() -> set[str]:
    for name in _OP_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        # The CPU op is registered when a CPU GDN layer is built; do it here.
        getattr(module, "register_cpu_gdn_attention_ops", lambda: None)()
    return set(compat._registered_vllm_ops())  # vLLM's ops (conftest hides the suite's stand-ins)


def test_this_release_is_a_tested_one():
    assert vllm.__version__.split("+")[0] in compat.TESTED_RELEASES


def test_every_core_op_of_this_release_is_registered_with_the_known_schema(registered_ops):
    # The ops this release registers (on any platform: the CPU wheel registers
    # the CUDA ops too) are exactly those the table gives this release.
    expected = {op.qualname for op in compat.CORE_OPS if _in_releases(op.releases)}
    expected.discard("vllm::gdn_attention_core_xpu")  # registered only on XPU builds
    looks_like = {n for n in registered_ops if compat.LOOKS_LIKE_STATE_OP.search(n)}
    assert expected <= registered_ops, f"not registered by vLLM {vllm.__version__}: {expected - registered_ops}"
    assert looks_like <= set(KNOWN_OPAQUE_STATE_OPS), looks_like - set(KNOWN_OPAQUE_STATE_OPS)
    assert compat.core_op_problems() == []


def test_every_registered_core_op_gets_a_guarded_op_with_its_schema(registered_ops):
    for qualname in sorted(registered_ops & set(KNOWN_OPAQUE_STATE_OPS)):
        op = getattr(torch.ops.vllm, qualname.split("::")[1]).default
        guarded = guarded_overload(op, KNOWN_OPAQUE_STATE_OPS[qualname])
        assert [(a.name, str(a.type)) for a in guarded._schema.arguments] == [
            (a.name, str(a.type)) for a in op._schema.arguments]
        assert [a.alias_info is not None and a.alias_info.is_write for a in guarded._schema.arguments] == [
            a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments]


def test_an_unknown_state_op_is_a_problem(monkeypatch, registered_ops):
    real = compat._registered_vllm_ops()
    monkeypatch.setattr(compat, "_registered_vllm_ops", lambda: real + ["vllm::qwen_gdn_attention_core_v2"])
    assert compat.core_op_problems() == [
        "vllm::qwen_gdn_attention_core_v2 looks like a GDN/KDA core op but gdn-pass does not know it"]


def test_a_renamed_argument_is_a_problem(monkeypatch, registered_ops):
    qualname = "vllm::qwen_gdn_attention_core"
    spec = KNOWN_OPAQUE_STATE_OPS[qualname]
    renamed = type(spec)(qualname, ("qkv",) + spec.arg_names[1:], spec.layer_arg, spec.family)
    monkeypatch.setitem(KNOWN_OPAQUE_STATE_OPS, qualname, renamed)
    [problem] = compat.core_op_problems()
    assert problem.startswith(qualname) and "differ from the known" in problem


def test_builder_context_from_positional_and_keyword_arguments():
    init = builders.GDN.builder_class().__init__
    spec, names, config, device = object(), ["a.linear_attn", "b.linear_attn"], object(), "cpu"
    positional = compat.builder_context(init, None, (spec, names, config, device), {})
    keyword = compat.builder_context(init, None, (), dict(
        kv_cache_spec=spec, layer_names=names, vllm_config=config, device=torch.device(device)))
    assert positional == keyword
    assert positional.layer_names == ("a.linear_attn", "b.linear_attn")
    assert positional.device == torch.device("cpu")


def test_step_inputs_from_positional_and_keyword_calls():
    build = builders.GDN.builder_class().build
    common = object()
    assert compat.step_inputs(build, None, (0, common), {})[0] is common
    assert compat.step_inputs(build, None, (), dict(common_prefix_len=0, common_attn_metadata=common))[0] is common
    drafts = object()
    assert compat.step_inputs(build, None, (0, common, None, drafts), {}) == (common, drafts)
    assert compat.step_inputs(build, None, (), dict(common_prefix_len=0, common_attn_metadata=common,
                                                    num_decode_draft_tokens_cpu=drafts)) == (common, drafts)
    assert compat.step_inputs(build, None, (0, common), {}) == (common, None)


def test_pad_slot_ids_are_this_vllms():
    from vllm.v1.attention.backends import utils

    assert utils.PAD_SLOT_ID in compat.pad_slot_ids()
    if hasattr(utils, "NULL_BLOCK_ID"):
        assert utils.NULL_BLOCK_ID in compat.pad_slot_ids()


def test_inductor_pass_base_is_vllms():
    base = compat.inductor_pass_base()
    assert base.__name__ == "InductorPass" and base.__module__.startswith("vllm.compilation")
