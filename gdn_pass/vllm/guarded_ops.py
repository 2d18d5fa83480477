"""Guarded ops: vLLM's GDN core ops under a new name, same schema, fresh-row state zeroed first.

``gdn_pass::guarded_<name>`` is defined from the original op's schema (only
the name changes), so auto_functionalized, reinplacing, DCE and Inductor's
fallback-kernel codegen treat it exactly like the original. Its body is the
op guard (``op_guard.zero_fresh_state``), then vLLM's function for the op::

    before:  torch.ops.vllm.X(args)          -> dispatcher -> X's Python function
    after:   torch.ops.gdn_pass.guarded_X(args) -> dispatcher -> zero_fresh_state(layer)
                                                              -> X's Python function

vLLM's function is called directly, not through ``torch.ops.vllm.X``:
a second trip through the dispatcher (Python arguments to the C++ stack and
back) costs about 4.5 us per call on a CPU host, per GDN layer of every
step that runs the guarded ops (piecewise steps; a replayed FULL graph runs
none). vLLM registers each core op with the function of the same name in
the module that defines it (``direct_register_custom_op``); where that
function cannot be found for certain, the guarded op calls the original
through the dispatcher, as before.

Guarded ops are defined when the pass rewrites a graph, and also on first lookup
(``torch.ops.gdn_pass.guarded_<name>``): a compiled graph loaded from a cache
in a fresh process calls the guarded op although no pass ran there.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch

from gdn_pass._logging import logger
from gdn_pass.opaque_ops import OpaqueStateOp
from gdn_pass.vllm.op_guard import zero_fresh_state

__all__ = ["guarded_overload", "guarded_name", "define_on_lookup", "registered_function"]

_LIB = torch.library.Library("gdn_pass", "FRAGMENT")
_DEFINED: dict[str, torch._ops.OpOverload] = {}
_DEFINING: set[str] = set()  # Library.define probes the namespace for the new name


def guarded_name(op: torch._ops.OpOverload) -> str:
    return "guarded_" + op.name().split("::", 1)[1]


def guarded_overload(op: torch._ops.OpOverload, spec: OpaqueStateOp) -> torch._ops.OpOverload:
    """Define (once per process) and return the guarded op of ``op``."""
    name = guarded_name(op)
    if name not in _DEFINED:
        _DEFINING.add(name)
        try:
            _LIB.define(name + _schema_tail(op))
        finally:
            _DEFINING.discard(name)
        _LIB.impl(name, _guarded_impl(op, spec), "CompositeExplicitAutograd")
        _LIB._register_fake(name, _fake_impl)
        _DEFINED[name] = getattr(torch.ops.gdn_pass, name).default
    return _DEFINED[name]


def stand_down_reason(spec: OpaqueStateOp) -> str | None:
    """Why the compiled graph's op needs no guarded op (vLLM fixed the builders of the layers it reads,
    ``builders.reading(spec.family)``, in this engine), or None.

    Asked by the pass at compile time, with vLLM's current config where it has
    set one (vLLM's CPU compile sets none; the platform decides there). Where
    it cannot tell, the op is guarded; the guarded op passes through if the builder
    then stands down.
    """
    from vllm.config import get_current_vllm_config_or_none

    from gdn_pass.vllm import builders, support

    config = get_current_vllm_config_or_none()
    # The op needs no guard only where every builder of the layers it reads stands down.
    reasons = [support.stand_down_reason(entry, config) for entry in builders.reading(spec.family)]
    if not reasons or None in reasons:
        return None
    return "; ".join(dict.fromkeys(reasons))


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


def registered_function(op: torch._ops.OpOverload) -> Callable | None:
    """The Python function the dispatcher runs for ``op``, or None where it cannot be found for certain.

    vLLM's ``direct_register_custom_op(op_name=name, op_func=fn)`` keeps no
    reference to ``fn`` that torch exposes; every core op gdn-pass guards is
    registered, in every release, with the module-level function of the op's
    own name in a module of the op's namespace. That function is taken when
    it is the only one of that name there and its parameters are the op
    schema's arguments, in order. Asked once per op, when its guarded op is
    defined (the op is registered by then, so its module is imported).
    """
    namespace, name = op.name().split("::", 1)
    found: list[Callable] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == namespace or module_name.startswith(namespace + ".")):
            continue
        fn = getattr(module, "__dict__", {}).get(name)
        if inspect.isfunction(fn) and fn.__name__ == name and fn not in found:  # re-exported: one function
            found.append(fn)
    if len(found) != 1:
        return None
    try:
        parameters = list(inspect.signature(found[0]).parameters)
    except (TypeError, ValueError):
        return None
    return found[0] if parameters == [arg.name for arg in op._schema.arguments] else None


def _guarded_impl(op: torch._ops.OpOverload, spec: OpaqueStateOp):
    index, family = spec.layer_arg_index, spec.family
    function = registered_function(op)
    if function is None:
        logger.info("gdn-pass: %s's Python function not found; its guarded op calls it through the "
                    "dispatcher (about 4.5 us more per call)", op.name())
    original = op if function is None else function

    def impl(*args, **kwargs):
        layer = kwargs[spec.layer_arg] if spec.layer_arg in kwargs else args[index]
        zero_fresh_state(getattr(layer, "value", layer), family)
        return original(*args, **kwargs)

    impl.__name__ = f"guarded_{spec.qualname.split('::')[1]}"
    return impl


def _fake_impl(*args, **kwargs) -> None:
    return None


def _original_of(name: str) -> tuple[torch._ops.OpOverload, OpaqueStateOp]:
    from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS

    tail = name.removeprefix("guarded_")
    for qualname, spec in KNOWN_OPAQUE_STATE_OPS.items():
        namespace, op_name = qualname.split("::", 1)
        if op_name == tail:
            packet = getattr(getattr(torch.ops, namespace), op_name, None)
            if packet is None:
                break
            return packet.default, spec
    raise AttributeError(
        f"gdn_pass::{name} guards {tail!r}, which is not a registered known GDN core op in "
        "this process: import the model (or vLLM layer) that defines it before running a "
        "graph compiled with gdn-pass, or clear the compile cache"
    )


class _GuardedNamespace(type(torch.ops.gdn_pass)):
    # Op packets take their __module__ from the namespace's class; FX prints
    # targets from it, so it must stay torch's.
    __module__ = type(torch.ops.gdn_pass).__module__

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if not name.startswith("guarded_") or name in _DEFINED or name in _DEFINING:
                raise
        guarded_overload(*_original_of(name))
        return super().__getattr__(name)


def define_on_lookup() -> None:
    """Let ``torch.ops.gdn_pass.guarded_<op>`` define the guarded op on first use."""
    torch.ops.gdn_pass.__class__ = _GuardedNamespace


define_on_lookup()
