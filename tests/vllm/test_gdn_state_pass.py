"""The rewrite of vLLM's opaque GDN core ops, on hand-built post-grad graphs; the adapter's
registration of them with the core pass."""

import importlib
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.fx import Graph, GraphModule

import gdn_pass
from gdn_pass import opaque_ops
from gdn_pass.vllm import VllmGDNStatePass
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
    VllmGDNStatePass()(g)
    assert targets(g) == ["gdn_pass::guarded_cpu_gdn_attention_core"] * 3
    (report,) = gdn_pass.reports()
    assert report.guarded_per_op() == {"vllm::cpu_gdn_attention_core": 3}
    assert [r.layer for r in report.guarded] == [f"model.layers.{i}.linear_attn" for i in range(3)]
    assert report.graph_changed


def test_guarded_op_has_the_original_schema():
    g = gdn_graph(1)
    VllmGDNStatePass()(g)
    guarded = torch.ops.gdn_pass.guarded_cpu_gdn_attention_core.default
    original, guarded_schema = CPU_CORE._schema, guarded._schema
    assert [(a.name, str(a.type), a.is_write) for a in guarded_schema.arguments] == [
        (a.name, str(a.type), a.is_write) for a in original.arguments
    ]
    assert guarded_schema.returns == original.returns


def test_pass_is_idempotent():
    g = gdn_graph(2)
    VllmGDNStatePass()(g)
    after_first = str(g)
    gdn_pass.clear_reports()
    VllmGDNStatePass()(g)
    assert str(g) == after_first
    (report,) = gdn_pass.reports()
    assert [r.action for r in report.reads] == ["already_guarded"] * 2
    assert not report.graph_changed


def test_disabled_option_leaves_graph(caplog):
    g = gdn_graph(1)
    before = str(g)
    VllmGDNStatePass(guard_opaque_ops=False)(g)
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
            VllmGDNStatePass()(g)
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
    VllmGDNStatePass()(g)
    (read,) = gdn_pass.reports()[0].reads
    assert read.action == "left_alone" and read.op == "vllm::gdn_pass_test_future_gdn_core"
    assert "unknown op" in read.reason


# --- the adapter's registration with the core (gdn_pass.vllm.registration) ------------


def test_the_core_pass_treats_vllm_ops_as_the_vllm_pass_does_once_the_adapter_is_imported():
    # The core class knows the ops through the registry: guarded, or stood down on 0.31+ CPU.
    done = []
    for pass_ in (VllmGDNStatePass(), gdn_pass.GDNStatePass()):
        g = gdn_graph(2)
        gdn_pass.clear_reports()
        pass_(g)
        (report,) = gdn_pass.reports()
        done.append((targets(g), [(r.op, r.action, r.reason) for r in report.reads]))
    assert done[0] == done[1]
    assert [op for op, _, _ in done[1][1]] == ["vllm::cpu_gdn_attention_core"] * 2
    assert all((action, reason.startswith("not needed")) in {("guarded_op", False), ("not_needed", True)}
               for _, action, reason in done[1][1])


def test_without_the_adapter_vllm_ops_are_reported_not_skipped(monkeypatch):
    for namespace in list(opaque_ops.ENGINES):
        monkeypatch.delitem(opaque_ops.ENGINES, namespace)
    for qualname in list(opaque_ops.KNOWN_OPAQUE_STATE_OPS):
        monkeypatch.delitem(opaque_ops.KNOWN_OPAQUE_STATE_OPS, qualname)
    g = gdn_graph(1)
    before = str(g)
    gdn_pass.clear_reports()
    gdn_pass.GDNStatePass()(g)
    assert str(g) == before
    (read,) = gdn_pass.reports()[0].left_alone
    assert read.op == "vllm::cpu_gdn_attention_core" and read.layer == "model.layers.0.linear_attn"
    assert "no engine adapter is registered for the 'vllm' op namespace" in read.reason


def test_the_plugin_entry_point_registers_the_adapter():
    # What vLLM's plugin loader does, in a process where nothing else imported the adapter.
    code = textwrap.dedent("""
        import gdn_pass
        from gdn_pass import opaque_ops
        assert not opaque_ops.ENGINES, opaque_ops.ENGINES
        from gdn_pass.vllm.plugin import register
        from gdn_pass.vllm import compat
        assert set(opaque_ops.ENGINES) == {"vllm"}
        assert opaque_ops.KNOWN_OPAQUE_STATE_OPS == {
            op.qualname: opaque_ops.OpaqueStateOp(op.qualname, op.arg_names, op.layer_arg, op.family)
            for op in compat.CORE_OPS}
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("module", ["compat", "builders", "guarded_ops", "op_guard", "piecewise"])
def test_uuid_follows_the_adapters_source(module, monkeypatch):
    import inspect

    from gdn_pass import state_pass

    changed = importlib.import_module(f"gdn_pass.vllm.{module}")
    before = VllmGDNStatePass().uuid()
    getsource = inspect.getsource
    monkeypatch.setattr(state_pass.inspect, "getsource",
                        lambda m: getsource(m) + ("# edited" if m is changed else ""))
    assert VllmGDNStatePass().uuid() != before


# --- the vLLM form of the pass: its names --------------------------------------------------


def test_the_earlier_name_still_gives_the_vllm_pass_and_loads_its_pickles():
    """``gdn_pass.vllm.GDNStatePass`` (this class's name before it became ``VllmGDNStatePass``)
    still works in configs, and a pickle that names it (an engine's config written then) loads
    as the vLLM pass with the same key."""
    import pickle

    import gdn_pass.vllm
    from gdn_pass.vllm import gdn_state_pass

    assert gdn_pass.vllm.GDNStatePass is VllmGDNStatePass
    assert gdn_pass.vllm.GDNStatePass is not gdn_pass.GDNStatePass
    VllmGDNStatePass.__qualname__ = "GDNStatePass"  # as it was named: pickles store the qualified name
    try:
        old = pickle.dumps(VllmGDNStatePass())
    finally:
        VllmGDNStatePass.__qualname__ = "VllmGDNStatePass"
    assert b"gdn_pass.vllm.gdn_state_pass" in old and b"VllmGDNStatePass" not in old
    loaded = pickle.loads(old)
    assert type(loaded) is gdn_state_pass.VllmGDNStatePass
    assert loaded.uuid() == VllmGDNStatePass().uuid()
