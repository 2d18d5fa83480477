"""Tensor names and shapes of the Qwen-style blocks the Qwen3-Next, Qwen3.5 and
InternS2-Mobius checkpoints share (``c`` is the text config); the multimodal
layouts' vision tower is the test harness's (``harness/families/qwen_vision.py``).

    gdn(prefix, c, fused)   linear_attn: fused in_proj_qkvz / in_proj_ba (Qwen3-Next)
                            or separate in_proj_qkv / z / b / a (Qwen3.5 layout)
    gated_attention(...)    self_attn with an output gate folded into q_proj
    routed_experts(...)     a router and per-expert gate/up/down projections
    shared_expert(...)      the gated shared expert
    decoder_layer(...)      norms, GDN or gated attention, then MoE (routed + shared
                            experts, when ``c`` has ``num_experts``) or a dense MLP
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
