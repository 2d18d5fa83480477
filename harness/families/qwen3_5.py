"""Tiny Qwen3.5 checkpoints, dense and MoE, in two layouts.

* ``qwen3_5`` / ``qwen3_5_moe``: text-only ``Qwen3_5ForCausalLM`` /
  ``Qwen3_5MoeForCausalLM`` (``model_type`` ``qwen3_5_text`` /
  ``qwen3_5_moe_text``): no ``text_config`` nesting, no vision tower. vLLM
  registers these architectures (and these config types) from 0.27 on; vLLM
  0.26 has the classes but not in its registry, so it cannot load them.
* ``qwen3_5_vl`` / ``qwen3_5_moe_vl``: the layout of the released Qwen3.5
  checkpoints, ``Qwen3_5ForConditionalGeneration`` /
  ``Qwen3_5MoeForConditionalGeneration`` (``model_type`` ``qwen3_5`` /
  ``qwen3_5_moe``, vLLM's own ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` in 0.26
  to 0.30) with the text model under ``text_config`` and a tiny vision tower.
  They load in vLLM 0.26 (CUDA) and 0.30 (CPU) alike; run them with every
  modality's prompt limit at 0 (``FAMILY_ENGINE_ARGS``): without a tokenizer
  vLLM cannot build the image processor, and with the limits at 0 it does not
  build the vision tower either (its weights are skipped).
* ``qwen3_5_mtp`` / ``qwen3_5_moe_mtp``: the ``_vl`` checkpoints plus one
  multi-token-prediction layer (``text_config.mtp_num_hidden_layers = 1``,
  tensors ``mtp.*`` as in the released checkpoints). With
  ``speculative_config={"method": "mtp", ...}`` vLLM (0.26 and 0.30) turns
  ``model_type`` ``qwen3_5`` / ``qwen3_5_moe`` into ``qwen3_5_mtp`` and builds
  the drafter ``Qwen3_5MTP`` / ``Qwen3_5MoeMTP``, which reads ``mtp.fc``,
  ``mtp.pre_fc_norm_{hidden,embedding}``, ``mtp.layers.0`` (a full-attention
  decoder layer, with the model's MLP), ``mtp.norm``, and shares the target's
  ``embed_tokens`` and ``lm_head``; the target skips ``mtp.*``.

vLLM builds every variant on Qwen3-Next's decoder, with two differences that
decide the tensor names here:

* the GDN input projections are stored unfused and in plain ``[q, k, v]``,
  ``z``, ``b``, ``a`` order (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``); vLLM's ``Qwen3_5Model.hf_to_vllm_mapper`` stacks them into
  ``in_proj_qkvz`` / ``in_proj_ba`` (``gqa_interleaved_layout=False``);
* the dense model has a plain gated MLP in every layer, the MoE model a
  routed-experts block plus a gated shared expert in every layer.

On CPU the GDN layer (``QwenGatedDeltaNetAttention.forward_cpu``) calls the
opaque op ``vllm::cpu_gdn_attention_core``, the same op as Qwen3-Next; on
CUDA (0.26) the GDN core is ``vllm::qwen_gdn_attention_core``.

Importing vLLM's ``qwen3_5`` model module needs torchvision even for the
text-only classes: it imports ``qwen3_vl``, which imports ``smart_resize``
from transformers' ``qwen2_vl.image_processing_qwen2_vl``, a module that
imports ``torchvision.transforms.v2`` at top level (transformers 5.10 to
5.24). PyPI has only CUDA builds of torchvision, which cannot load next to
the CPU torch, so the project's environments have none.
``gdn_pass.vllm.checker.model_loading.allow_import_without_torchvision`` serves
transformers' PIL variant of that module instead (same ``smart_resize``); the
scenarios call it in the engine process before vLLM loads the model.
"""

from __future__ import annotations

from collections.abc import Iterator

from gdn_pass.checker import qwen_layers
from gdn_pass.checker.checkpoints import TINY_GDN_DECODER, TINY_TOKENS
from harness.families import qwen_vision

_COMMON = {
    **TINY_GDN_DECODER,
    # Plain (not multimodal) rope: no mrope_section, so positions stay 1-D.
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "partial_rotary_factor": 0.25,
    **TINY_TOKENS,
}

QWEN3_5_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    **_COMMON,
    "intermediate_size": 512,
}

QWEN3_5_MOE_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    **_COMMON,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "norm_topk_prob": True,
}


def _multimodal(architecture: str, model_type: str, text: dict, **text_extra) -> dict:
    """The released layout: ``text`` (a text-only config above) under ``text_config``."""
    text_config = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")}
    return qwen_vision.multimodal_config(architecture, model_type, {**text_config, **text_extra})


QWEN3_5_VL_CONFIG = _multimodal("Qwen3_5ForConditionalGeneration", "qwen3_5", QWEN3_5_CONFIG)
QWEN3_5_MOE_VL_CONFIG = _multimodal("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", QWEN3_5_MOE_CONFIG)
QWEN3_5_MTP_CONFIG = _multimodal("Qwen3_5ForConditionalGeneration", "qwen3_5", QWEN3_5_CONFIG,
                                 mtp_num_hidden_layers=1)
QWEN3_5_MOE_MTP_CONFIG = _multimodal("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", QWEN3_5_MOE_CONFIG,
                                     mtp_num_hidden_layers=1)


def _decoder_layer(p: str, kind: str, c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    # Unfused, non-interleaved GDN projections (Qwen3.5 checkpoint layout).
    return qwen_layers.decoder_layer(p, kind, c, fused_gdn=False)


def _text_model(lm: str, c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The language model under prefix ``lm``, and the ``lm_head`` (always top level)."""
    h, v = c["hidden_size"], c["vocab_size"]
    yield f"{lm}.embed_tokens.weight", (v, h)
    yield f"{lm}.norm.weight", (h,)
    yield "lm_head.weight", (v, h)
    for i, kind in enumerate(c["layer_types"]):
        yield from _decoder_layer(f"{lm}.layers.{i}", kind, c)


def _qwen3_5_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield from _text_model("model", c)


def _qwen3_5_vl_tensors(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    c = config["text_config"]
    yield from _text_model("model.language_model", c)
    yield from qwen_vision.vision_tower("model.visual", config["vision_config"])
    h = c["hidden_size"]
    for i in range(c.get("mtp_num_hidden_layers", 0)):  # the MTP drafter's layers
        yield from _decoder_layer(f"mtp.layers.{i}", "full_attention", c)
    if c.get("mtp_num_hidden_layers", 0):
        yield "mtp.fc.weight", (h, 2 * h)  # [embedding, hidden] -> hidden
        for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
            yield f"mtp.{norm}.weight", (h,)


CHECKPOINTS = {
    "qwen3_5": (QWEN3_5_CONFIG, _qwen3_5_tensors),
    "qwen3_5_moe": (QWEN3_5_MOE_CONFIG, _qwen3_5_tensors),
    "qwen3_5_vl": (QWEN3_5_VL_CONFIG, _qwen3_5_vl_tensors),
    "qwen3_5_moe_vl": (QWEN3_5_MOE_VL_CONFIG, _qwen3_5_vl_tensors),
    "qwen3_5_mtp": (QWEN3_5_MTP_CONFIG, _qwen3_5_vl_tensors),
    "qwen3_5_moe_mtp": (QWEN3_5_MOE_MTP_CONFIG, _qwen3_5_vl_tensors),
}
