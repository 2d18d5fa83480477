"""Tiny InternS2-Mobius checkpoint (``InternS2MobiusForConditionalGeneration``), text path.

InternS2-Mobius is Qwen3.5-MoE shaped (Qwen3.5 Gated DeltaNet layers, gated
full attention, a Qwen3-VL vision tower) with one twist: the routed experts
live in ``num_blocks`` MoE banks (``model.language_model.meta_mlp.{b}``)
shared by all decoder layers, layer ``i`` using bank ``i % num_blocks``; each
layer keeps only its shared expert (``layers.{i}.mlp.shared_expert*``).

Config: vLLM 0.30 has no config class for the published ``model_type``
(``interns2_mobius``, remote code), so the tiny checkpoint declares
``qwen3_5_moe``, vLLM's own config class, whose text config keeps the
Mobius-only field ``num_blocks`` as a plain attribute. The architecture,
and so the model class vLLM builds, is InternS2-Mobius's.

Tensor names are those of the Hugging Face checkpoint as vLLM maps them
(``model.language_model.*`` -> ``language_model.model.*``,
``model.visual.*`` -> ``visual.*``; ``in_proj_qkv/z/b/a`` fused by
``Qwen3_5Model.hf_to_vllm_mapper``). The vision tower is built by vLLM
unless every modality's prompt limit is 0, so it is present but tiny
(depth 1, hidden 32).

vLLM registers ``InternS2MobiusForConditionalGeneration`` from 0.28 on; 0.26
(CUDA) does not have it. Its nearest relative there,
``InternS2PreviewForConditionalGeneration``, is a plain
``Qwen3_5MoeForConditionalGeneration`` (the ``qwen3_5_moe_vl`` checkpoint's
model, GDN core ``vllm::qwen_gdn_attention_core``).
"""

from __future__ import annotations

from collections.abc import Iterator

from gdn_pass.checker import qwen_layers
from gdn_pass.checker.checkpoints import TINY_GDN_DECODER
from harness.families import qwen_vision

__all__ = ["INTERNS2_MOBIUS_CONFIG", "CHECKPOINTS"]

_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    **TINY_GDN_DECODER,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "norm_topk_prob": True,
    "num_blocks": 2,  # MoE banks shared across layers: layer i routes through bank i % 2
    "layer_scale": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

INTERNS2_MOBIUS_CONFIG = qwen_vision.multimodal_config(
    "InternS2MobiusForConditionalGeneration", "qwen3_5_moe", _TEXT_CONFIG)


def _interns2_mobius_tensors(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    c = config["text_config"]
    h, v = c["hidden_size"], c["vocab_size"]
    lm = "model.language_model"
    yield f"{lm}.embed_tokens.weight", (v, h)
    yield f"{lm}.norm.weight", (h,)
    yield "lm_head.weight", (v, h)
    for b in range(c["num_blocks"]):  # the shared routed-expert banks
        yield from qwen_layers.routed_experts(f"{lm}.meta_mlp.{b}", c)
    for i, kind in enumerate(c["layer_types"]):
        p = f"{lm}.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        if kind == "linear_attention":
            # Qwen3.5 layout: q, k, v and the output gate z as separate blocks
            yield from qwen_layers.gdn(f"{p}.linear_attn", c, fused=False)
        else:
            yield from qwen_layers.gated_attention(f"{p}.self_attn", c)
        # per-layer shared expert only; routed experts are in meta_mlp
        yield from qwen_layers.shared_expert(f"{p}.mlp", c)
    yield from qwen_vision.vision_tower("model.visual", config["vision_config"])


CHECKPOINTS = {"interns2_mobius": (INTERNS2_MOBIUS_CONFIG, _interns2_mobius_tensors)}
