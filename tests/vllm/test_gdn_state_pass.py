"""The rewrite of vLLM's opaque GDN core ops, on hand-built post-grad graphs."""

import logging

import pytest
import torch
from torch.fx import Graph, GraphModule

import gdn_pass
from gdn_pass import opaque_ops
from gdn_pass.vllm import GDNStatePass
from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import register_cpu_gdn_attention_ops

register_cpu_gdn_attention_ops()
CPU_CORE = torch.ops.vllm.cpu_gdn_attention_core.default
AUTO_FUNC = torch.ops.higher_order.auto_functionalized


def gdn_graph(num_layers: int, *, wrapped: bool = True) -> Graph:
    g = Graph()
    qkv, b, a = g.placeholder("qkv"), g.placeholder("b"), g.placeholder("a")
    outs = []
    for i in range(num_layers):
        out = g.placeholder(f"out{i}")
        layer = f"model.layers.{i}.linear_attn"
        if wrapped:
            node = g.call_function(AUTO_FUNC, (CPU_CORE,), dict(
                mixed_qkv=qkv, b=b, a=a, core_attn_out=out, layer_name=layer))
            outs.append(g.call_function(lambda t, i: t[i], (node, 1)))
        else:
            g.call_function(CPU_CORE, (qkv, b, a, out, layer))
            outs.append(out)
    g.output(tuple(outs))
    GraphModule(torch.nn.Module(), g)  # gives the graph an owning module, as Inductor does
    return g


def targets(g: Graph) -> list[str]:
    found = []
    for n in g.nodes:
        op = n.args[0] if n.target is AUTO_FUNC else n.target
        if isinstance(op, torch._ops.OpOverload):
            found.append(op.name())
    return found


@pytest.mark.parametrize("wrapped", [True, False], ids=["auto_functionalized", "direct"])
def test_every_core_op_swapped_once(wrapped):
    g = gdn_graph(3, wrapped=wrapped)
    gdn_pass.clear_reports()
    GDNStatePass()(g)
    assert targets(g) == ["gdn_pass::guarded_cpu_gdn_attention_core"] * 3
    (report,) = gdn_pass.reports()
    assert report.guarded_per_op() == {"vllm::cpu_gdn_attention_core": 3}
    assert [r.layer for r in report.guarded] == [f"model.layers.{i}.linear_attn" for i in range(3)]
    assert report.graph_changed


def test_guarded_op_has_the_original_schema():
    g = gdn_graph(1)
    GDNStatePass()(g)
    guarded = torch.ops.gdn_pass.guarded_cpu_gdn_attention_core.default
    original, twin = CPU_CORE._schema, guarded._schema
    assert [(a.name, str(a.type), a.is_write) for a in twin.arguments] == [
        (a.name, str(a.type), a.is_write) for a in original.arguments
    ]
    assert twin.returns == original.returns


def test_pass_is_idempotent():
    g = gdn_graph(2)
    GDNStatePass()(g)
    after_first = str(g)
    gdn_pass.clear_reports()
    GDNStatePass()(g)
    assert str(g) == after_first
    (report,) = gdn_pass.reports()
    assert [r.action for r in report.reads] == ["already_guarded"] * 2
    assert not report.graph_changed


def test_disabled_option_leaves_graph(caplog):
    g = gdn_graph(1)
    before = str(g)
    GDNStatePass(guard_opaque_ops=False)(g)
    assert str(g) == before


def test_changed_schema_is_left_alone_and_reported(monkeypatch, caplog):
    spec = opaque_ops.KNOWN_OPAQUE_STATE_OPS["vllm::cpu_gdn_attention_core"]
    changed = opaque_ops.OpaqueStateOp(spec.qualname, ("x", "b", "a", "core_attn_out", "layer_name"))
    monkeypatch.setitem(opaque_ops.KNOWN_OPAQUE_STATE_OPS, spec.qualname, changed)
    g = gdn_graph(1)
    before = str(g)
    gdn_pass.clear_reports()
    with caplog.at_level(logging.WARNING, logger="gdn_pass"):
        logging.getLogger("gdn_pass").propagate = True
        try:
            GDNStatePass()(g)
        finally:
            logging.getLogger("gdn_pass").propagate = False
    assert str(g) == before
    (read,) = gdn_pass.reports()[0].reads
    assert read.action == "left_alone" and "schema changed" in read.reason
    assert "cpu_gdn_attention_core left unguarded" in caplog.text


def test_unknown_gdn_looking_op_is_reported():
    lib = torch.library.Library("vllm", "FRAGMENT")
    lib.define("gdn_pass_test_future_gdn_core(Tensor(a!) out, str layer_name) -> ()")
    op = torch.ops.vllm.gdn_pass_test_future_gdn_core.default
    g = Graph()
    out = g.placeholder("out")
    g.call_function(op, (out, "model.layers.0.linear_attn"))
    g.output(out)
    gdn_pass.clear_reports()
    GDNStatePass()(g)
    (read,) = gdn_pass.reports()[0].reads
    assert read.action == "left_alone" and read.op == "vllm::gdn_pass_test_future_gdn_core"
    assert "unknown op" in read.reason
