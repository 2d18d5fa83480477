"""GDNStatePass: guard recurrent-state reads so fresh rows read zero state.

Opaque engine ops (vLLM's GDN core ops) keep their node; only the target
changes, to a guarded op of the same schema that zeroes the state slots of
rows with ``valid & ~has_initial_state`` before it runs the original::

    before:
        auto_functionalized(vllm.cpu_gdn_attention_core.default,
                            mixed_qkv=q, b=b, a=a, core_attn_out=o,
                            layer_name='model.layers.0.linear_attn')
    after:
        auto_functionalized(gdn_pass.guarded_cpu_gdn_attention_core.default,
                            mixed_qkv=q, b=b, a=a, core_attn_out=o,
                            layer_name='model.layers.0.linear_attn')

Keeping the guard inside the op's own node means it cannot be dead-code
eliminated or scheduled after the op, and mutation/aliasing information is
unchanged. The pass is idempotent: a node already on a guarded op is counted,
not wrapped again. A graph with no GDN layer is left unchanged and reported.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import sys
import time
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from gdn_pass import gated_reads, opaque_ops, report as report_mod, state_reads
from gdn_pass.gated_reads import GateBuilder
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.opaque_ops import ENGINES, KNOWN_OPAQUE_STATE_OPS, LOOKS_LIKE_STATE_OP
from gdn_pass.report import PassReport, StateRead
from gdn_pass.state_reads import find_state_gathers
from inductor_ext import gated_gather

__all__ = ["GDNStatePass", "GUARDED_NAMESPACE"]

from gdn_pass._logging import logger

GUARDED_NAMESPACE = "gdn_pass"

# Core modules whose source decides what the pass does to a graph (uuid input);
# each registered engine adapter adds its own (``opaque_ops.EngineAdapter.behaviour``).
_BEHAVIOUR_MODULES = (sys.modules[__name__], state_reads, gated_reads, gated_gather, opaque_ops)

_AUTO_FUNCTIONALIZED = tuple(
    getattr(torch.ops.higher_order, name)
    for name in ("auto_functionalized", "auto_functionalized_v2")
    if hasattr(torch.ops.higher_order, name)
)


class GDNStatePass(CustomGraphPass):
    """Inductor post-grad pass that guards GDN recurrent-state reads.

    Use as ``torch.compile(model, options={"post_grad_custom_post_pass":
    GDNStatePass()})``. For vLLM, use ``gdn_pass.vllm.VllmGDNStatePass``.

    Args:
        metadata: staged per-row metadata that graph-visible state reads are
            gated on (read in place by the compiled graph). Without it such
            reads are reported and left unguarded.
        masked_load: gate graph-visible reads with the masked-load lowering
            (fresh and padding rows never touch memory); when False, or when
            the lowering cannot be registered, with ``where`` after a gather
            at a safe index. The report says which ran.
        guard_opaque_ops: swap known engine GDN core ops for guarded variants
            (the ops of the registered engine adapters: ``opaque_ops.register_engine``).
        report_dir: where each graph's report is written (JSON + text); the
            environment variable ``GDN_PASS_REPORT_DIR`` is used when unset.
            Not part of ``uuid()``: it does not change the compiled graph.
    """

    def __init__(
        self,
        metadata: StagedRowMetadata | None = None,
        *,
        masked_load: bool = True,
        guard_opaque_ops: bool = True,
        report_dir: str | None = None,
    ):
        self.metadata = metadata
        self.masked_load = masked_load
        self.guard_opaque_ops = guard_opaque_ops
        self.report_dir = report_dir

    # -- configuration ---------------------------------------------------
    def options(self) -> dict[str, Any]:
        """Options that change the rewritten graph (hashed into ``uuid()``)."""
        return {
            "guard_opaque_ops": self.guard_opaque_ops,
            "masked_load": self.masked_load,
            "metadata": repr(self.metadata),
        }

    def uuid(self) -> str | None:
        if self.metadata is not None:
            # The graph holds this object's buffers by reference; a cached
            # graph would hold unpickled copies. None makes Inductor bypass
            # its FX graph cache.
            return None
        hasher = hashlib.sha256()
        hasher.update(f"{type(self).__module__}.{type(self).__qualname__}".encode())
        hasher.update(json.dumps(self.options(), sort_keys=True).encode())
        for module in _behaviour_modules():
            hasher.update(inspect.getsource(module).encode())
        return hasher.hexdigest()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options()})"

    # -- the pass --------------------------------------------------------
    def __call__(self, graph: torch.fx.Graph) -> None:
        start = time.perf_counter()
        _dump_graph("gdn_pass_before", graph)
        before = str(graph)
        report = PassReport(
            pass_name=f"{type(self).__module__}.{type(self).__qualname__}",
            pass_uuid=self.uuid(),
            options=self.options(),
            num_nodes=len(graph.nodes),
            analyses=["graph_visible_gathers", "opaque_ops"],
            versions=_versions(),
        )
        report.reads.extend(self._guard_gathers(graph))
        for node, op in _opaque_op_calls(graph):
            report.reads.append(self._guard_opaque_call(node, op))
        graph.lint()
        report.graph_changed = str(graph) != before
        _dump_graph("gdn_pass_after", graph)
        report.seconds = time.perf_counter() - start
        report_mod.record(report, self.report_dir)
        level = logging.WARNING if report.left_alone else logging.INFO
        logger.log(level, "%s", report.summary())

    def _guard_gathers(self, graph: torch.fx.Graph) -> list[StateRead]:
        gathers, skipped = find_state_gathers(graph)
        reads = [
            StateRead(node=s.node.name, kind="gather", op=str(s.node.target), layer=None,
                      action="not_state", reason=s.reason)
            for s in skipped
        ]
        if not gathers:
            return reads
        if self.metadata is None:
            logger.warning(
                "%d graph-visible state read(s) left unguarded: GDNStatePass was given no "
                "metadata; pass GDNStatePass(metadata=StagedRowMetadata(...))", len(gathers))
            return reads + [
                StateRead(node=g.read.name, kind="gather", op=str(g.read.target),
                          layer=g.cache.name, action="left_alone",
                          reason="no staged metadata given to the pass",
                          cache=_describe(g.cache), index_source=g.index.name)
                for g in gathers
            ]
        masked = self.masked_load and gated_gather.register_lowering() is None
        how = "masked load (gdn_pass::gated_gather lowering)" if masked else (
            "where after a gather at a safe index"
            + ("" if not self.masked_load else f" (lowering unavailable: {gated_gather.LOWERING_ERROR})")
        )
        builder = GateBuilder(graph, self.metadata, masked_load=masked)
        writes_done: set[torch.fx.Node] = set()
        for g in gathers:
            reads.append(StateRead(
                node=g.read.name, kind="gather", op=str(g.read.target), layer=g.cache.name,
                action="guarded_gather", guard="masked_load" if masked else "where",
                cache=_describe(g.cache), index_source=g.index.name,
                reason=f"{how}; {len(g.writes)} write-back(s) of padding rows "
                       + (f"sent to scratch slot {self.metadata.scratch_slot}"
                          if self.metadata.scratch_slot is not None
                          else "folded onto the first real row")))
            builder.gate_read(g)
            for put in g.writes:
                if put not in writes_done:
                    builder.gate_write(put)
                    writes_done.add(put)
        return reads

    def _guard_opaque_call(self, node: torch.fx.Node, op: torch._ops.OpOverload) -> StateRead:
        qualname = op.name()
        namespace = qualname.split("::")[0]
        spec = KNOWN_OPAQUE_STATE_OPS.get(qualname)
        read = StateRead(
            node=node.name, kind="opaque_op", op=qualname,
            layer=_layer_name(node, spec), action="left_alone", reason="",
        )
        if namespace == GUARDED_NAMESPACE:
            read.action, read.reason = "already_guarded", "node already calls a guarded op"
            return read
        engine = ENGINES.get(namespace)
        if engine is None:
            read.reason = (
                f"no engine adapter is registered for the {namespace!r} op namespace, so its GDN/KDA "
                "core ops are neither known nor guarded: import the engine's adapter (gdn_pass.vllm "
                "for vLLM; its GDNStatePass and plugin import it) before the pass runs"
            )
            logger.warning("%s left unguarded: no engine adapter registered for %r", qualname, namespace)
            return read
        if spec is None:
            read.reason = (
                f"unknown op whose name suggests GDN/KDA state; add it to {engine.name}'s "
                "op table once its state access is known"
            )
            logger.warning("%s left unguarded: not a known GDN core op", qualname)
            return read
        mismatch = opaque_ops.schema_mismatch(op, spec)
        if mismatch is not None:
            read.reason = f"schema changed ({mismatch}); vLLM version not supported"
            logger.warning(
                "%s left unguarded: %s (vLLM %s). Upgrade gdn-pass or "
                "report the new schema.", qualname, mismatch, _versions().get("vllm"),
            )
            return read
        if not self.guard_opaque_ops:
            read.reason = "guard_opaque_ops=False"
            return read
        stand_down = engine.guards.stand_down_reason(spec)
        if stand_down is not None:
            read.action, read.reason = "not_needed", f"not needed: {stand_down}"
            return read
        guarded = engine.guards.guarded_overload(op, spec)
        if node.target in _AUTO_FUNCTIONALIZED:
            node.args = (guarded, *node.args[1:])
        else:
            node.target = guarded
        read.action, read.guard = "guarded_op", "guarded_op"
        read.reason = (f"target swapped to {guarded.name()} (same schema); state reached through "
                       "the forward context (layer.kv_cache), slots from the staged rows")
        return read


def _behaviour_modules():
    yield from _BEHAVIOUR_MODULES
    for engine in ENGINES.values():
        yield from engine.behaviour


def _opaque_op_calls(graph: torch.fx.Graph):
    """(node, op) for every call of a known or GDN-looking op, direct or wrapped.

    GDN-looking ops are looked for in the namespaces of the registered engine
    adapters and the guarded ops' own; with no adapter registered, in every
    namespace, so that an engine graph run without its adapter is reported.
    """
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        op = node.target
        if op in _AUTO_FUNCTIONALIZED and node.args:
            op = node.args[0]
        if isinstance(op, torch._ops.OpOverloadPacket) and "default" in op.overloads():
            op = op.default  # Dynamo-level graphs (vLLM's piecewise split) call packets
        if not isinstance(op, torch._ops.OpOverload):
            continue
        qualname = op.name()
        namespace, _, name = qualname.partition("::")
        if qualname in KNOWN_OPAQUE_STATE_OPS or (
            (not ENGINES or namespace in (*ENGINES, GUARDED_NAMESPACE)) and LOOKS_LIKE_STATE_OP.search(name)
        ):
            yield node, op


def _layer_name(node: torch.fx.Node, spec) -> str | None:
    if spec is None:
        value = node.kwargs.get("layer_name")
    elif spec.layer_arg in node.kwargs:
        value = node.kwargs[spec.layer_arg]
    else:
        # Direct call: positional args follow the schema order.
        idx = spec.layer_arg_index
        value = node.args[idx] if idx < len(node.args) else None
    if isinstance(value, torch.fx.Node):
        # Hoisted opaque values (vLLM's LayerName on torch >= 2.11) are graph
        # inputs; their example value still names the layer.
        value = value.meta.get("val", value.meta.get("example_value"))
        value = getattr(value, "real_obj", getattr(value, "wrapped_obj", value))
    value = getattr(value, "value", value)  # vLLM's LayerName wraps a str
    return value if isinstance(value, str) else None


def _describe(node: torch.fx.Node) -> str | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
    return None


def _dump_graph(name: str, graph: torch.fx.Graph) -> None:
    # Same channel as Inductor's and vLLM's passes: depyf and TORCH_LOGS see it.
    gm = graph.owning_module
    if gm is not None:
        from torch._dynamo.utils import lazy_format_graph_code

        logger.debug("%s", lazy_format_graph_code(name, gm))


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    try:
        from importlib.metadata import version

        versions["gdn_pass"] = version("gdn-pass")
    except Exception:
        pass
    import sys

    vllm = sys.modules.get("vllm")
    if vllm is not None:
        versions["vllm"] = getattr(vllm, "__version__", "unknown")
    return versions
