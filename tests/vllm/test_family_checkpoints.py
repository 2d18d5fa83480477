"""The tiny family checkpoints load in the vLLM releases the project runs.

Fast checks (config parsing, architecture registered, OLMo-hybrid's conv
loader) run here on vLLM 0.30 (CPU); what they stand for on vLLM 0.26 (CUDA,
the GPU machine) is in each test's docstring and in the family modules.
The slow tests run the Qwen3.5 checkpoints in the released (multimodal)
layout, the ones vLLM 0.26 can load, through the scenario on vLLM's CPU
backend, and build and load their MTP drafters.
"""

import re
import sys

import pytest
import torch
from torch import nn

import gdn_pass
from gdn_pass.checker.demo import LOGPROB_TOL, run_demo
from gdn_pass.vllm.checker.model_loading import prepare_engine_process
from harness.families import FAMILY_ENGINE_ARGS, kind_for_vllm
from harness.families.bailing_moe_v3 import BAILING_MOE_V3_CONFIG
from harness.families.kimi_linear import KIMI_LINEAR_CONFIG
from harness.tiny_checkpoints import CHECKPOINTS, EXTRA_FILES, write_checkpoint

@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_config_parses_and_architecture_is_registered(kind, tmp_path):
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import get_config

    model = write_checkpoint(kind, tmp_path / kind)
    # A kind that ships its config class (EXTRA_FILES) is read through it, as its engines do.
    config = get_config(str(model), trust_remote_code=bool(EXTRA_FILES.get(kind)))
    assert config.architectures[0] in ModelRegistry.get_supported_archs()
    assert config.model_type == CHECKPOINTS[kind][0]["model_type"]
    if EXTRA_FILES.get(kind):  # the shipped class keeps every value (vLLM folds the rope keys together)
        for key, value in CHECKPOINTS[kind][0].items():
            if not key.startswith(("rope", "partial_rotary", "auto_map", "torch_dtype")):
                assert getattr(config, key) == value, key


def test_kinds_for_vllm_026():
    assert kind_for_vllm("qwen3_5", "0.26.0") == "qwen3_5_vl"
    assert kind_for_vllm("qwen3_5_moe", "0.26.0") == "qwen3_5_moe_vl"
    assert kind_for_vllm("interns2_mobius", "0.26.0") is None
    assert kind_for_vllm("bailing_moe_v3", "0.26.0") is None
    for kind in ("qwen3_next", "qwen3_next_mtp", "olmo_hybrid", "kimi_linear", "qwen3_5_vl", "qwen3_5_mtp"):
        assert kind_for_vllm(kind, "0.26.0") == kind
    for kind in ("qwen3_5", "interns2_mobius", "bailing_moe_v3"):
        assert kind_for_vllm(kind, "0.30.0") == kind


def test_mla_dims_are_deepseek_v3s():
    """On Hopper vLLM's only MLA prefill backend (FlashAttention) takes three dim sets;
    0.26 rejected the earlier (32, 64, 32) with "No valid MLA prefill backend"."""
    for config in (KIMI_LINEAR_CONFIG, BAILING_MOE_V3_CONFIG):
        dims = (config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"])
        assert dims == (128, 64, 128)
        assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576


class _FusedConvLayer(nn.Module):
    """Just the fused ``conv1d`` of ``OlmoHybridGatedDeltaNet``, with its loader."""

    def __init__(self, dims):
        super().__init__()
        from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn as mod
        from vllm.model_executor.utils import set_weight_attrs

        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(sum(dims), 1, 4), requires_grad=False)
        set_weight_attrs(self.conv1d.weight,
                         {"weight_loader": mod._make_fused_conv1d_weight_loader(dims, 1, 0)})


def _load_olmo_convs(dims):
    """q/k/v convs through OLMo-hybrid's own mapper and AutoWeightsLoader, as vLLM loads them."""
    from vllm.model_executor.models.olmo_hybrid import OlmoHybridModel
    from vllm.model_executor.models.utils import AutoWeightsLoader

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].linear_attn = _FusedConvLayer(dims)
    weights = [(f"layers.0.linear_attn.{name}_conv1d.weight", torch.full((d, 1, 4), float(i + 1)))
               for i, (name, d) in enumerate(zip("qkv", dims))]
    AutoWeightsLoader(model).load_weights(weights, mapper=OlmoHybridModel.hf_to_vllm_mapper)
    return model.layers[0].linear_attn.conv1d.weight


def test_olmo_hybrid_conv_loader_needs_the_fix_and_the_fix_loads(monkeypatch, tmp_path):
    from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn as mod

    monkeypatch.setattr(mod, "_make_fused_conv1d_weight_loader", mod._make_fused_conv1d_weight_loader)
    dims = [8, 8, 16]
    # vLLM 0.26-0.30 as shipped: the failure the H200 run hit with vLLM 0.26
    with pytest.raises(TypeError, match="list indices must be integers or slices, not NoneType"):
        _load_olmo_convs(dims)

    model = write_checkpoint("olmo_hybrid", tmp_path / "olmo_hybrid")
    assert prepare_engine_process(str(model)) == ["olmo_hybrid fused conv1d loader (vllm#55858)"]
    assert prepare_engine_process(str(model)) == [], "applied once"
    weight = _load_olmo_convs(dims)
    assert weight[:8].eq(1).all() and weight[8:16].eq(2).all() and weight[16:].eq(3).all()
    assert prepare_engine_process(str(write_checkpoint("qwen3_5", tmp_path / "qwen3_5"))) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_released_qwen3_5_layout_bug_reproduced_and_fixed(kind, engine_dir):
    """The Qwen3.5 checkpoints vLLM 0.26 loads run the scenario like the text-only ones."""
    demo = run_demo(engine_dir / f"family_{kind}", kind=kind, python=sys.executable,
                    progress=lambda msg: None, extra_args=FAMILY_ENGINE_ARGS[kind])
    s = demo["summary"]
    reports = gdn_pass.load_reports(demo["results"]["pass_on"]["report_dir"])
    assert demo["results"]["pass_off"]["fresh_decode_steps"] > 0
    assert any(r["action"] == "guarded_op" for rep in reports for r in rep["reads"])
    assert not s["r3_pass_off_vs_isolated"]["matches"], "without the pass R3 must read stale state"
    on = s["r3_pass_on_vs_isolated"]
    assert on["same_tokens"] and on["max_logprob_diff"] <= LOGPROB_TOL, on
    assert s["r2_pass_on_vs_pass_off"]["same_tokens"], s["r2_pass_on_vs_pass_off"]


# An engine with the MTP drafter, in process. vLLM inspects the drafter's class
# (Qwen3_5MTP) in a subprocess, which imports torchvision through qwen3_5.py;
# the project's CPU environments have none, so both classes are registered here,
# behind the import alias, as gdn_pass.vllm.checker.scenarios does for the target alone.
_MTP_ENGINE = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
model, target, drafter = sys.argv[1:4]
from vllm import LLM, ModelRegistry
from gdn_pass.vllm.checker.model_loading import allow_import_without_torchvision
if allow_import_without_torchvision():
    for arch in (target, drafter):
        ModelRegistry.register_model(arch, ModelRegistry._try_load_model_cls(arch))
LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256,
    max_num_seqs=4, gpu_memory_utilization=0.3, limit_mm_per_prompt={"image": 0, "video": 0},
    speculative_config={"method": "mtp", "num_speculative_tokens": 1})
print("ENGINE STARTED")
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_5_mtp", "qwen3_5_moe_mtp"])
def test_qwen3_5_mtp_drafter_loads(kind, engine_dir):
    """Target and drafter (``Qwen3_5MTP`` / ``Qwen3_5MoeMTP``) build and load every weight
    (vLLM's strict check: no parameter left out); vLLM's CPU backend cannot go further
    (its rejection sampler is a Triton kernel, see tests/vllm/test_modes.py)."""
    import os
    import subprocess

    model = write_checkpoint(kind, engine_dir / f"tiny_{kind}", seed=0)
    config = CHECKPOINTS[kind][0]
    drafter = "Qwen3_5MoeMTP" if "moe" in kind else "Qwen3_5MTP"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG"}  # one line per loaded weight
    proc = subprocess.run([sys.executable, "-c", _MTP_ENGINE, str(model), config["architectures"][0], drafter],
                          env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ENGINE STARTED" in log, log[-3000:]
    assert re.search(rf"Resolved architecture: {drafter}\b", log)
    drafter_log = log[log.index("Loading drafter model"):]
    for name in ("fc.weight", "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight", "norm.weight"):
        assert re.search(rf"Loaded weight {re.escape(name)} ", drafter_log), name
