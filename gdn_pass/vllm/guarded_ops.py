"""Guarded twins of vLLM's GDN core ops: same schema, fresh-row state zeroed first.

``gdn_pass::guarded_<name>`` is defined from the original op's schema (only
the name changes), so auto_functionalized, reinplacing, DCE and Inductor's
fallback-kernel codegen treat it exactly like the original.
"""

from __future__ import annotations

import torch

from gdn_pass.opaque_ops import OpaqueStateOp
from gdn_pass.vllm.state_guard import zero_fresh_state

__all__ = ["guarded_overload", "guarded_name"]

_LIB = torch.library.Library("gdn_pass", "FRAGMENT")
_DEFINED: dict[str, torch._ops.OpOverload] = {}


def guarded_name(op: torch._ops.OpOverload) -> str:
    return "guarded_" + op.name().split("::", 1)[1]


def guarded_overload(op: torch._ops.OpOverload, spec: OpaqueStateOp) -> torch._ops.OpOverload:
    """Define (once per process) and return the guarded twin of ``op``."""
    name = guarded_name(op)
    if name not in _DEFINED:
        _LIB.define(name + _schema_tail(op))
        _LIB.impl(name, _guarded_impl(op, spec), "CompositeExplicitAutograd")
        _LIB._register_fake(name, _fake_impl)
        _DEFINED[name] = getattr(torch.ops.gdn_pass, name).default
    return _DEFINED[name]


def _schema_tail(op: torch._ops.OpOverload) -> str:
    """The schema after the op name, with opaque argument types spelled out.

    Opaque types print as ``PyObject``, which the schema parser rejects; vLLM's
    LayerName is the only opaque type its GDN core ops use.
    """
    tail = "(" + str(op._schema).split("(", 1)[1]
    if "PyObject" in tail:
        from torch._library.opaque_object import get_opaque_type_name
        from vllm.utils.torch_utils import LayerName

        tail = tail.replace("PyObject", get_opaque_type_name(LayerName))
    return tail


def _guarded_impl(op: torch._ops.OpOverload, spec: OpaqueStateOp):
    index = spec.layer_arg_index

    def impl(*args, **kwargs):
        layer = kwargs[spec.layer_arg] if spec.layer_arg in kwargs else args[index]
        zero_fresh_state(getattr(layer, "value", layer))
        return op(*args, **kwargs)

    impl.__name__ = f"guarded_{spec.qualname.split('::')[1]}"
    return impl


def _fake_impl(*args, **kwargs) -> None:
    return None
