"""Engine ops that read GDN/KDA recurrent state inside, and the engine adapters that know them.

These ops hide the state read: the caches are reached through the engine's
forward context (``layer.kv_cache``), not through graph inputs, so no gather
is visible in the graph. They are guarded at op granularity: the node keeps
its place, arguments and mutation semantics, and only its target changes to a
guarded op with the same schema that zeroes the slots of fresh rows before
calling the original.

The core knows no engine. An engine adapter registers, when it is imported,
what the pass needs from it (``register_engine``)::

    register_engine(EngineAdapter(
        namespace="vllm", name="gdn_pass.vllm",
        ops=(OpaqueStateOp("vllm::cpu_gdn_attention_core", (...), ...), ...),
        guards=guarded_ops,                        # stand_down_reason, guarded_overload
        behaviour=(compat, builders, guarded_ops, ...)))   # source hashed into uuid()

An op is recognised only if its schema has exactly the argument names its
adapter lists for it; an op that looks like a GDN/KDA core op but is not
listed (a newer engine release, a renamed argument) is reported and left
unchanged, and so is such an op while no adapter is registered at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

__all__ = [
    "EngineAdapter",
    "OpGuards",
    "OpaqueStateOp",
    "ENGINES",
    "KNOWN_OPAQUE_STATE_OPS",
    "LOOKS_LIKE_STATE_OP",
    "register_engine",
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


class OpGuards(Protocol):
    """How an engine's opaque ops get their guarded variants."""

    def stand_down_reason(self, spec: OpaqueStateOp) -> str | None:
        """Why the op needs no guard in this engine (the engine fixed it), or None."""

    def guarded_overload(self, op: torch._ops.OpOverload, spec: OpaqueStateOp) -> torch._ops.OpOverload:
        """The guarded variant of ``op``: same schema, fresh rows' state zeroed first."""


@dataclass(frozen=True)
class EngineAdapter:
    """What an engine adapter tells the core pass.

    Attributes:
        namespace: the op namespace of the engine's ops (``vllm``).
        name: the adapter's package, for messages.
        ops: the engine's opaque state ops of every supported release.
        guards: makes their guarded variants.
        behaviour: modules whose source decides what the pass does to a
            graph; hashed into ``GDNStatePass.uuid()``.
    """

    namespace: str
    name: str
    ops: tuple[OpaqueStateOp, ...]
    guards: OpGuards
    behaviour: tuple[ModuleType, ...] = ()


# Registered adapters, by op namespace.
ENGINES: dict[str, EngineAdapter] = {}

# Every registered adapter's ops, by qualname (what the pass matches on).
KNOWN_OPAQUE_STATE_OPS: dict[str, OpaqueStateOp] = {}

# Ops we do not know but whose names say they carry GDN/KDA state: these are
# reported as "left alone" so nothing is skipped silently.
LOOKS_LIKE_STATE_OP = re.compile(r"gdn|kda|gated_delta|delta_rule", re.IGNORECASE)


def register_engine(adapter: EngineAdapter) -> None:
    """Make an engine's ops known to the pass (idempotent: a namespace's entry is replaced)."""
    foreign = [op.qualname for op in adapter.ops if op.qualname.split("::")[0] != adapter.namespace]
    if foreign:
        raise ValueError(f"{adapter.name} registers ops outside its namespace {adapter.namespace!r}: {foreign}")
    previous = ENGINES.get(adapter.namespace)
    if previous is not None:
        for op in previous.ops:
            KNOWN_OPAQUE_STATE_OPS.pop(op.qualname, None)
    ENGINES[adapter.namespace] = adapter
    KNOWN_OPAQUE_STATE_OPS.update((op.qualname, op) for op in adapter.ops)


def schema_mismatch(op: torch._ops.OpOverload, spec: OpaqueStateOp) -> str | None:
    """Why ``op``'s schema does not match ``spec``, or None when it does."""
    schema = op._schema
    names = tuple(a.name for a in schema.arguments)
    if names != spec.arg_names:
        return f"arguments {names} differ from the known {spec.arg_names}"
    if schema.returns:
        return f"op returns {len(schema.returns)} values; known GDN core ops return ()"
    return None
