"""Engine ops that read GDN/KDA recurrent state inside, known by name and schema.

These ops hide the state read: the caches are reached through the engine's
forward context (``layer.kv_cache``), not through graph inputs, so no gather
is visible in the graph. They are guarded at op granularity: the node keeps
its place, arguments and mutation semantics, and only its target changes to a
guarded op with the same schema that zeroes the slots of fresh rows before
calling the original.

An op is recognised only if its schema has exactly the argument names the
vLLM adapter (``gdn_pass.vllm.compat.CORE_OPS``) lists for it; an op that
looks like a GDN/KDA core op but is not listed (a newer vLLM, a renamed
argument) is reported and left unchanged, and an engine that configured the
pass stops at start-up on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_pass.vllm import compat as _vllm_compat  # imports no vLLM

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


# vLLM's GDN/KDA core ops of every supported release, with their schemas; the
# table and its release notes live in the vLLM adapter.
KNOWN_OPAQUE_STATE_OPS: dict[str, OpaqueStateOp] = {
    op.qualname: OpaqueStateOp(op.qualname, op.arg_names, op.layer_arg, op.family)
    for op in _vllm_compat.CORE_OPS
}

# Ops we do not know but whose names say they carry GDN/KDA state: these are
# reported as "left alone: unknown op" so nothing is skipped silently.
LOOKS_LIKE_STATE_OP = _vllm_compat.LOOKS_LIKE_STATE_OP


def schema_mismatch(op: torch._ops.OpOverload, spec: OpaqueStateOp) -> str | None:
    """Why ``op``'s schema does not match ``spec``, or None when it does."""
    schema = op._schema
    names = tuple(a.name for a in schema.arguments)
    if names != spec.arg_names:
        return f"arguments {names} differ from the known {spec.arg_names}"
    if schema.returns:
        return f"op returns {len(schema.returns)} values; known GDN core ops return ()"
    return None
