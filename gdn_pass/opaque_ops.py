"""Engine ops that read GDN/KDA recurrent state inside, known by name and schema.

These ops hide the state read: the caches are reached through the engine's
forward context (``layer.kv_cache``), not through graph inputs, so no gather
is visible in the graph. They are guarded at op granularity: the node keeps
its place, arguments and mutation semantics, and only its target changes to a
guarded op with the same schema that zeroes the slots of fresh rows before
calling the original.

An op is recognised only if its schema has exactly the argument names listed
here; an op that looks like a GDN/KDA core op but is not listed (a newer
vLLM, a renamed argument) is reported and left unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = [
    "OpaqueStateOp",
    "KNOWN_OPAQUE_STATE_OPS",
    "LOOKS_LIKE_STATE_OP",
    "schema_mismatch",
]


@dataclass(frozen=True)
class OpaqueStateOp:
    """A custom op that reads and writes one layer's state slots internally.

    Attributes:
        qualname: ``namespace::name`` of the op.
        arg_names: the schema's argument names, in order.
        layer_arg: the argument naming the layer whose state the op touches.
        family: model family / layer type, for the report.
    """

    qualname: str
    arg_names: tuple[str, ...]
    layer_arg: str = "layer_name"
    family: str = "gdn"

    @property
    def layer_arg_index(self) -> int:
        return self.arg_names.index(self.layer_arg)


# Schemas as registered by vLLM 0.30 / 0.31 (`direct_register_custom_op`).
KNOWN_OPAQUE_STATE_OPS: dict[str, OpaqueStateOp] = {
    op.qualname: op
    for op in (
        OpaqueStateOp(
            "vllm::cpu_gdn_attention_core",
            ("mixed_qkv", "b", "a", "core_attn_out", "layer_name"),
        ),
        OpaqueStateOp(
            "vllm::qwen_gdn_attention_core",
            ("qkv_or_qkvz", "b_or_ba", "a_or_z_out", "core_attn_out", "layer_name", "use_aiter"),
        ),
        OpaqueStateOp(
            "vllm::qwen_gdn_attention_core_fused_norm_packed",
            ("mixed_qkvz", "ba", "core_attn_out", "layer_name"),
        ),
        OpaqueStateOp(
            "vllm::olmo_hybrid_gdn_full_forward",
            ("hidden_states", "output", "layer_name"),
        ),
        OpaqueStateOp(
            "vllm::gdn_attention_core_xpu",
            ("core_attn_out", "z", "projected_states_qkvz", "projected_states_ba", "layer_name"),
        ),
        OpaqueStateOp(
            "vllm::bailing_v3_kda_attention",
            ("q_proj_states", "k_proj_states", "v_proj_states", "g1", "beta", "core_attn_out", "layer_name"),
            family="kda",
        ),
    )
}

# Ops we do not know but whose names say they carry GDN/KDA state: these are
# reported as "left alone: unknown op" so nothing is skipped silently.
LOOKS_LIKE_STATE_OP = re.compile(r"gdn|kda|gated_delta|delta_rule", re.IGNORECASE)


def schema_mismatch(op: torch._ops.OpOverload, spec: OpaqueStateOp) -> str | None:
    """Why ``op``'s schema does not match ``spec``, or None when it does."""
    schema = op._schema
    names = tuple(a.name for a in schema.arguments)
    if names != spec.arg_names:
        return f"arguments {names} differ from the known {spec.arg_names}"
    if schema.returns:
        return f"op returns {len(schema.returns)} values; known GDN core ops return ()"
    return None
