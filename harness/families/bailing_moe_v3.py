"""Tiny Bailing-MoE-v3 (Ling hybrid): Kimi Delta Attention layers, one MLA layer, MoE.

vLLM's ``BailingMoeV3ForCausalLM`` (model_executor/models/bailing_moe_v3.py)
reads the Hugging Face ``bailing_hybrid`` config that transformers ships.
With ``layer_group_size == num_hidden_layers == 4`` layers 0-2 are KDA and
layer 3 is MLA. The KDA state update runs inside the opaque op
``vllm::bailing_v3_kda_attention``.

Config choices that matter:
  * transformers' ``BailingHybridConfig`` overwrites ``head_dim`` with
    ``qk_rope_head_dim``, while vLLM sizes KDA heads (and the KDA state) by
    ``head_dim``; keeping both equal makes the two agree.
  * vLLM reads ``num_experts``, ``num_shared_experts``,
    ``moe_shared_expert_intermediate_size``, ``use_bias`` and ``no_kda_lora``
    (which must be true), names the HF config does not define; they are kept
    as extra config attributes.
  * checkpoint names use ``.attention.``; vLLM maps them to ``.self_attn.``.

vLLM registers ``BailingMoeV3ForCausalLM`` from 0.28 on; 0.26 (CUDA) does not
have it. 0.26's Bailing linear-attention model is ``BailingMoeV2_5ForCausalLM``
(``bailing_moe_linear.py``): Lightning-style linear attention (no delta rule,
no conv) behind ``vllm::linear_attention``, on ``LinearAttentionMetadataBuilder``
(``v1/attention/backends/linear_attn.py``), not on the GDN builder.
"""

from __future__ import annotations

from collections.abc import Iterator

from gdn_pass.checker.checkpoints import TINY_TOKENS, embedding_and_head_tensors
BAILING_MOE_V3_CONFIG = {
    "architectures": ["BailingMoeV3ForCausalLM"],
    "model_type": "bailing_hybrid",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_group_size": 4,  # layers 0-2 KDA, layer 3 MLA
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,  # KDA head dim (see module docstring)
    "short_conv_kernel_size": 4,
    "no_kda_lora": True,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    # MLA (layer 3), no q-LoRA; DeepSeek-V3's dims, the only ones every CUDA
    # MLA backend takes (see kimi_linear.py)
    "q_lora_rank": None,
    "kv_lora_rank": 512,  # + qk_rope_head_dim = 576, the MLA cache's head size
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "gated_attention_proj_granularity_type": None,
    # MoE on every layer but the first
    "first_k_dense_replace": 1,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 128,
    "num_shared_experts": 1,
    "n_shared_experts": 1,
    "moe_shared_expert_intermediate_size": 128,
    "routed_scaling_factor": 1.0,
    "use_bias": False,
    "num_mtp_layers": 0,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    **TINY_TOKENS,
    "pad_token_id": 0,
}


def _is_kda(layer: int, c: dict) -> bool:
    group, n = c["layer_group_size"], c["num_hidden_layers"]
    return (layer + 1) % group != 0 and layer < n // group * group


def _bailing_moe_v3_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h = c["hidden_size"]
    yield from embedding_and_head_tensors(c, "model.word_embeddings.weight")
    heads, hd = c["num_attention_heads"], c["head_dim"]
    proj = heads * hd
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        a = f"{p}.attention"
        if _is_kda(i, c):
            # q/k/v/b are stacked into qkvb_proj by vLLM's loader
            for name in ("q_proj", "k_proj", "v_proj"):
                yield f"{a}.{name}.weight", (proj, h)
            yield f"{a}.b_proj.weight", (heads, h)
            yield f"{a}.f_proj.weight", (proj, h)
            yield f"{a}.g_proj.weight", (proj, h)
            yield f"{a}.dt_bias", (proj,)
            yield f"{a}.A_log", (heads,)
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                yield f"{a}.{name}.weight", (proj, 1, c["short_conv_kernel_size"])
            yield f"{a}.o_norm.weight", (hd,)
            yield f"{a}.o_proj.weight", (h, proj)
        else:
            yield from bailing_mla(a, c)
        yield from bailing_mlp(f"{p}.mlp", c, dense=i < c["first_k_dense_replace"])


def bailing_mla(a: str, c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Bailing family's MLA attention block (no q-LoRA), under prefix ``a``; v3 and v2.5 alike."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, vd, kv_rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    yield f"{a}.q_proj.weight", (heads * (nope + rope), h)
    yield f"{a}.kv_a_proj_with_mqa.weight", (kv_rank + rope, h)
    yield f"{a}.kv_a_layernorm.weight", (kv_rank,)
    yield f"{a}.kv_b_proj.weight", (heads * (nope + vd), kv_rank)
    yield f"{a}.dense.weight", (h, heads * vd)


def bailing_mlp(m: str, c: dict, *, dense: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Bailing family's MLP under prefix ``m``: dense, or MoE with expert bias and shared experts."""
    h = c["hidden_size"]
    if dense:
        inter = c["intermediate_size"]
        yield f"{m}.gate_proj.weight", (inter, h)
        yield f"{m}.up_proj.weight", (inter, h)
        yield f"{m}.down_proj.weight", (h, inter)
        return
    moe, experts = c["moe_intermediate_size"], c["num_experts"]
    yield f"{m}.gate.weight", (experts, h)
    yield f"{m}.gate.expert_bias", (experts,)
    for e in range(experts):
        yield f"{m}.experts.{e}.gate_proj.weight", (moe, h)
        yield f"{m}.experts.{e}.up_proj.weight", (moe, h)
        yield f"{m}.experts.{e}.down_proj.weight", (h, moe)
    shared = c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"]
    yield f"{m}.shared_experts.gate_proj.weight", (shared, h)
    yield f"{m}.shared_experts.up_proj.weight", (shared, h)
    yield f"{m}.shared_experts.down_proj.weight", (h, shared)


CHECKPOINTS = {"bailing_moe_v3": (BAILING_MOE_V3_CONFIG, _bailing_moe_v3_tensors)}
