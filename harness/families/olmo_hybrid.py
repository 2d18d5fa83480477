"""Tiny OLMo-hybrid checkpoint (``OlmoHybridForCausalLM``): 3 Gated DeltaNet layers + 1 attention layer.

Tensor names are those of a Hugging Face OLMo-hybrid checkpoint as vLLM's
``OlmoHybridModel.hf_to_vllm_mapper`` reads them: separate ``q/k/v/g_proj``
(vLLM fuses them into ``in_proj_qkvg``), separate ``q/k/v_conv1d`` (fused into
one ``conv1d``), and separate ``a_proj`` / ``b_proj``. Linear-attention layers
norm before the mixer and the MLP (``input_layernorm``,
``post_attention_layernorm``); attention layers norm after them
(``post_attention_layernorm``, ``post_feedforward_layernorm``), OLMo-2 style.

vLLM runs the whole GDN layer as one opaque op,
``vllm::olmo_hybrid_gdn_full_forward(hidden_states, output, layer_name)``
(0.26 to 0.30, CUDA; vLLM's CPU backend cannot build the layer).

Loading: vLLM 0.26 to 0.30 cannot load the q/k/v short convolutions of any
OLMo-hybrid checkpoint, this one or ``allenai/Olmo-Hybrid-7B``: the mapper
tags each ``q/k/v_conv1d`` tensor with its shard id (``tensor.shard_id``),
``AutoWeightsLoader`` calls the parameter's loader with two arguments, and the
fused-conv loader (``_make_fused_conv1d_weight_loader`` in
``olmo_gdn_linear_attn.py``) only reads a third one, so it indexes its dims
with ``None``: ``TypeError: list indices must be integers or slices, not
NoneType`` (vllm PR #55858, open). No checkpoint layout avoids it (a
pre-fused ``conv1d.weight`` reaches the same loader without a shard id), so
``gdn_pass.vllm.checker.model_loading.fix_fused_conv1d_weight_loader`` applies that
PR's fix in the engine process, before vLLM builds the model, where the
installed vLLM needs it.
"""

from __future__ import annotations

from collections.abc import Iterator

from gdn_pass.checker.checkpoints import TINY_TOKENS, embedding_and_head_tensors
__all__ = ["OLMO_HYBRID_CONFIG", "CHECKPOINTS"]

OLMO_HYBRID_CONFIG = {
    "architectures": ["OlmoHybridForCausalLM"],
    "model_type": "olmo_hybrid",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,  # attention head_dim = hidden / heads = 64
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # GQA: vLLM expands q/k to the value heads
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_allow_neg_eigval": True,
    **TINY_TOKENS,
    "pad_token_id": 0,
}


def _olmo_hybrid_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, inter = c["hidden_size"], c["intermediate_size"]
    yield from embedding_and_head_tensors(c)
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    hd = h // heads
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    key_dim, value_dim = hk * c["linear_key_head_dim"], hv * c["linear_value_head_dim"]
    width = c["linear_conv_kernel_dim"]
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}"
        yield f"{p}.post_attention_layernorm.weight", (h,)
        if kind == "linear_attention":
            yield f"{p}.input_layernorm.weight", (h,)
            a = f"{p}.linear_attn"
            yield f"{a}.q_proj.weight", (key_dim, h)
            yield f"{a}.k_proj.weight", (key_dim, h)
            yield f"{a}.v_proj.weight", (value_dim, h)
            yield f"{a}.g_proj.weight", (value_dim, h)  # output gate of the gated RMSNorm
            yield f"{a}.a_proj.weight", (hv, h)
            yield f"{a}.b_proj.weight", (hv, h)
            # depthwise convs, nn.Conv1d layout (channels, 1, width)
            yield f"{a}.q_conv1d.weight", (key_dim, 1, width)
            yield f"{a}.k_conv1d.weight", (key_dim, 1, width)
            yield f"{a}.v_conv1d.weight", (value_dim, 1, width)
            yield f"{a}.dt_bias", (hv,)
            yield f"{a}.A_log", (hv,)
            yield f"{a}.o_norm.weight", (c["linear_value_head_dim"],)
            yield f"{a}.o_proj.weight", (h, value_dim)
        else:
            yield f"{p}.post_feedforward_layernorm.weight", (h,)
            a = f"{p}.self_attn"
            yield f"{a}.q_proj.weight", (heads * hd, h)
            yield f"{a}.k_proj.weight", (kv_heads * hd, h)
            yield f"{a}.v_proj.weight", (kv_heads * hd, h)
            yield f"{a}.o_proj.weight", (h, heads * hd)
            # OLMo-2 style qk-norm over the whole projection, not per head
            yield f"{a}.q_norm.weight", (heads * hd,)
            yield f"{a}.k_norm.weight", (kv_heads * hd,)
        m = f"{p}.mlp"
        yield f"{m}.gate_proj.weight", (inter, h)
        yield f"{m}.up_proj.weight", (inter, h)
        yield f"{m}.down_proj.weight", (h, inter)


CHECKPOINTS = {"olmo_hybrid": (OLMO_HYBRID_CONFIG, _olmo_hybrid_tensors)}
