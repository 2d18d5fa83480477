"""Tiny standalone Kimi-Linear: Kimi Delta Attention layers, one MLA layer, MoE.

vLLM registers ``KimiLinearForCausalLM`` from ``vllm.models.kimi_k3`` (the
NVIDIA implementation on every platform but ROCm/TPU) with vLLM's own
``KimiLinearConfig`` (``model_type: kimi_linear``). The KDA layers are
``KimiGatedDeltaNetAttention`` (model_executor/layers/mamba/gdn/
kimi_gdn_linear_attn.py) with the low-rank gate (``use_full_rank_gate``
false, the Kimi-Linear layout); layer numbers in ``linear_attn_config`` are
1-based, so layers 0-2 are KDA and layer 3 is MLA (NoPE, no q-LoRA).

Checkpoint names follow the Hugging Face Kimi-Linear release: q/k/v/b/f_a
projections and q/k/v short convolutions are stacked by vLLM's loader, routed
experts are ``w1``/``w2``/``w3`` under ``block_sparse_moe``, and ``A_log`` has
the released ``(1, 1, heads, 1)`` shape.

vLLM 0.26 (CUDA) builds ``KimiLinearForCausalLM`` from
``model_executor/models/kimi_linear.py`` instead: the same checkpoint names
(q/k/v/conv loaded unstacked), ``@support_torch_compile``, and the KDA state
read inside the opaque op ``vllm::kda_attention``. The MLA dims are the ones
its backends accept: on Hopper the only MLA prefill backend is FlashAttention
(``v1/attention/backends/mla/prefill/flash_attn.py``), which takes
(qk_nope, qk_rope, v) = (128, 64, 128), (192, 64, 256) or (64, 64, 128) and
nothing else ("No valid MLA prefill backend" otherwise; the same list in
0.27-0.30); the MLA cache head size (kv_lora_rank + qk_rope) must be 320 or
576, and the sparse / FlashInfer backends take only 576. (128, 64, 128) with
kv_lora_rank 512 is DeepSeek-V3's layout, which every backend supports, FA4 on
Blackwell included.
"""

from __future__ import annotations

from collections.abc import Iterator

from gdn_pass.checker.checkpoints import TINY_TOKENS, embedding_and_head_tensors
KIMI_LINEAR_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3],  # 1-based
        "full_attn_layers": [4],
        "num_heads": 4,
        "head_dim": 64,
        "short_conv_kernel_size": 4,
    },
    # MLA (layer 3): NoPE, full-rank q. DeepSeek-V3's (and the released
    # Kimi-Linear's) dims: the only ones every MLA backend takes (see the
    # module docstring).
    "q_lora_rank": None,
    "kv_lora_rank": 512,  # + qk_rope_head_dim = 576, the MLA cache's head size
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": False,
    # MoE on every layer but the first
    "num_experts": 4,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 128,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.446,
    "num_nextn_predict_layers": 0,
    **TINY_TOKENS,
    "pad_token_id": 0,
}


def _kimi_linear_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h = c["hidden_size"]
    yield from embedding_and_head_tensors(c)
    kda = c["linear_attn_config"]
    kheads, khd, width = kda["num_heads"], kda["head_dim"], kda["short_conv_kernel_size"]
    proj = kheads * khd
    heads = c["num_attention_heads"]
    nope, rope, vd, kv_rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        a = f"{p}.self_attn"
        if i + 1 in kda["kda_layers"]:
            for name in ("q_proj", "k_proj", "v_proj"):
                yield f"{a}.{name}.weight", (proj, h)
            yield f"{a}.b_proj.weight", (kheads, h)
            yield f"{a}.f_a_proj.weight", (khd, h)  # low-rank forget gate
            yield f"{a}.f_b_proj.weight", (proj, khd)
            yield f"{a}.g_a_proj.weight", (khd, h)  # low-rank output gate
            yield f"{a}.g_b_proj.weight", (proj, khd)
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                yield f"{a}.{name}.weight", (proj, 1, width)
            yield f"{a}.A_log", (1, 1, kheads, 1)
            yield f"{a}.dt_bias", (proj,)
            yield f"{a}.o_norm.weight", (khd,)
            yield f"{a}.o_proj.weight", (h, proj)
        else:
            yield f"{a}.q_proj.weight", (heads * (nope + rope), h)
            yield f"{a}.kv_a_proj_with_mqa.weight", (kv_rank + rope, h)
            yield f"{a}.kv_a_layernorm.weight", (kv_rank,)
            yield f"{a}.kv_b_proj.weight", (heads * (nope + vd), kv_rank)
            yield f"{a}.o_proj.weight", (h, heads * vd)
        moe_layer = i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0
        if not moe_layer:
            m, inter = f"{p}.mlp", c["intermediate_size"]
            yield f"{m}.gate_proj.weight", (inter, h)
            yield f"{m}.up_proj.weight", (inter, h)
            yield f"{m}.down_proj.weight", (h, inter)
            continue
        m, moe, experts = f"{p}.block_sparse_moe", c["moe_intermediate_size"], c["num_experts"]
        yield f"{m}.gate.weight", (experts, h)
        yield f"{m}.gate.e_score_correction_bias", (experts,)
        for e in range(experts):
            yield f"{m}.experts.{e}.w1.weight", (moe, h)  # gate
            yield f"{m}.experts.{e}.w3.weight", (moe, h)  # up
            yield f"{m}.experts.{e}.w2.weight", (h, moe)  # down
        shared = moe * c["num_shared_experts"]
        yield f"{m}.shared_experts.gate_proj.weight", (shared, h)
        yield f"{m}.shared_experts.up_proj.weight", (shared, h)
        yield f"{m}.shared_experts.down_proj.weight", (h, shared)


CHECKPOINTS = {"kimi_linear": (KIMI_LINEAR_CONFIG, _kimi_linear_tensors)}
