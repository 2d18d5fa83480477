"""Tensor names and shapes of the Qwen-style blocks the Qwen3-Next, Qwen3.5 and
InternS2-Mobius checkpoints share (``c`` is the text config).

    gdn(prefix, c, fused)   linear_attn: fused in_proj_qkvz / in_proj_ba (Qwen3-Next)
                            or separate in_proj_qkv / z / b / a (Qwen3.5 layout)
    gated_attention(...)    self_attn with an output gate folded into q_proj
    routed_experts(...)     a router and per-expert gate/up/down projections
    shared_expert(...)      the gated shared expert
    decoder_layer(...)      norms, GDN or gated attention, then MoE (routed + shared
                            experts, when ``c`` has ``num_experts``) or a dense MLP
    vision_tower(prefix, v) a tiny Qwen3-VL vision tower (``VISION_CONFIG``), for the
                            multimodal layouts (Qwen3.5, InternS2-Mobius)
    multimodal_config(...)  the released multimodal config around a text config
"""

from __future__ import annotations

from collections.abc import Iterator

Tensors = Iterator[tuple[str, tuple[int, ...]]]


def gdn(a: str, c: dict, *, fused: bool) -> Tensors:
    h = c["hidden_size"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv_dim = 2 * hk * dk + hv * dv  # the conv runs over q, k and v
    if fused:
        yield f"{a}.in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, h)
        yield f"{a}.in_proj_ba.weight", (2 * hv, h)
    else:
        yield f"{a}.in_proj_qkv.weight", (conv_dim, h)
        yield f"{a}.in_proj_z.weight", (hv * dv, h)
        yield f"{a}.in_proj_b.weight", (hv, h)
        yield f"{a}.in_proj_a.weight", (hv, h)
    yield f"{a}.conv1d.weight", (conv_dim, 1, c["linear_conv_kernel_dim"])
    yield f"{a}.dt_bias", (hv,)
    yield f"{a}.A_log", (hv,)
    yield f"{a}.norm.weight", (dv,)
    yield f"{a}.out_proj.weight", (h, hv * dv)


def gated_attention(a: str, c: dict) -> Tensors:
    h = c["hidden_size"]
    heads, kv_heads, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    yield f"{a}.q_proj.weight", (2 * heads * hd, h)  # query + output gate
    yield f"{a}.k_proj.weight", (kv_heads * hd, h)
    yield f"{a}.v_proj.weight", (kv_heads * hd, h)
    yield f"{a}.o_proj.weight", (h, heads * hd)
    yield f"{a}.q_norm.weight", (hd,)
    yield f"{a}.k_norm.weight", (hd,)


def routed_experts(m: str, c: dict) -> Tensors:
    h, inter = c["hidden_size"], c["moe_intermediate_size"]
    yield f"{m}.gate.weight", (c["num_experts"], h)
    for e in range(c["num_experts"]):
        yield f"{m}.experts.{e}.gate_proj.weight", (inter, h)
        yield f"{m}.experts.{e}.up_proj.weight", (inter, h)
        yield f"{m}.experts.{e}.down_proj.weight", (h, inter)


def shared_expert(m: str, c: dict) -> Tensors:
    h, shared = c["hidden_size"], c["shared_expert_intermediate_size"]
    yield f"{m}.shared_expert.gate_proj.weight", (shared, h)
    yield f"{m}.shared_expert.up_proj.weight", (shared, h)
    yield f"{m}.shared_expert.down_proj.weight", (h, shared)
    yield f"{m}.shared_expert_gate.weight", (1, h)


def decoder_layer(p: str, kind: str, c: dict, *, fused_gdn: bool) -> Tensors:
    """One decoder layer; ``kind`` is its ``layer_types`` entry."""
    h = c["hidden_size"]
    yield f"{p}.input_layernorm.weight", (h,)
    yield f"{p}.post_attention_layernorm.weight", (h,)
    if kind == "linear_attention":
        yield from gdn(f"{p}.linear_attn", c, fused=fused_gdn)
    else:
        yield from gated_attention(f"{p}.self_attn", c)
    m = f"{p}.mlp"
    if "num_experts" in c:
        yield from routed_experts(m, c)
        yield from shared_expert(m, c)
    else:
        inter = c["intermediate_size"]
        yield f"{m}.gate_proj.weight", (inter, h)
        yield f"{m}.up_proj.weight", (inter, h)
        yield f"{m}.down_proj.weight", (h, inter)


# A tiny Qwen3-VL vision tower: vLLM builds it unless every modality's prompt
# limit is 0 (then it is a StageMissingLayer and its weights are skipped), so
# it is present but small.
VISION_CONFIG = {
    "depth": 1,
    "hidden_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 256,  # = the text hidden_size of every tiny Qwen-style checkpoint
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [],
}


def vision_tower(v: str, c: dict) -> Tensors:
    d, inter, out = c["hidden_size"], c["intermediate_size"], c["out_hidden_size"]
    merged = d * c["spatial_merge_size"] ** 2
    yield f"{v}.patch_embed.proj.weight", (d, c["in_channels"], c["temporal_patch_size"],
                                           c["patch_size"], c["patch_size"])
    yield f"{v}.patch_embed.proj.bias", (d,)
    yield f"{v}.pos_embed.weight", (c["num_position_embeddings"], d)
    for i in range(c["depth"]):
        b = f"{v}.blocks.{i}"
        for norm in ("norm1", "norm2"):
            yield f"{b}.{norm}.weight", (d,)
            yield f"{b}.{norm}.bias", (d,)
        yield f"{b}.attn.qkv.weight", (3 * d, d)
        yield f"{b}.attn.qkv.bias", (3 * d,)
        yield f"{b}.attn.proj.weight", (d, d)
        yield f"{b}.attn.proj.bias", (d,)
        yield f"{b}.mlp.linear_fc1.weight", (inter, d)
        yield f"{b}.mlp.linear_fc1.bias", (inter,)
        yield f"{b}.mlp.linear_fc2.weight", (d, inter)
        yield f"{b}.mlp.linear_fc2.bias", (d,)
    m = f"{v}.merger"
    yield f"{m}.norm.weight", (d,)  # pre-shuffle norm: over the unmerged width
    yield f"{m}.norm.bias", (d,)
    yield f"{m}.linear_fc1.weight", (merged, merged)
    yield f"{m}.linear_fc1.bias", (merged,)
    yield f"{m}.linear_fc2.weight", (out, merged)
    yield f"{m}.linear_fc2.bias", (out,)


def multimodal_config(architecture: str, model_type: str, text_config: dict) -> dict:
    """The released multimodal layout: ``text_config`` next to the tiny vision tower."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text_config,
        "vision_config": VISION_CONFIG,
        # Special tokens at the top of the vocabulary, away from the prompt ids.
        "image_token_id": 1020,
        "video_token_id": 1021,
        "vision_start_token_id": 1022,
        "vision_end_token_id": 1023,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
