"""Guarded ops resolve in a process where no pass ran (a compile-cache hit)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from gdn_pass.vllm import guarded_ops


def test_guarded_op_is_defined_on_first_lookup_in_a_fresh_process():
    # A cached graph's code does exactly this lookup, with the model's ops
    # registered and no GDNStatePass run in the process.
    code = textwrap.dedent("""
        import torch
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
        gdn_attention.register_cpu_gdn_attention_ops()  # as the model's layer does
        import gdn_pass.vllm
        gdn_pass.vllm.install()
        guarded = torch.ops.gdn_pass.guarded_cpu_gdn_attention_core.default
        original = torch.ops.vllm.cpu_gdn_attention_core.default
        assert str(guarded._schema).split("(", 1)[1] == str(original._schema).split("(", 1)[1]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_unknown_guarded_op_says_what_to_do():
    with pytest.raises(AttributeError, match="not a registered known GDN core op"):
        torch.ops.gdn_pass.guarded_no_such_core_op


def test_other_gdn_pass_ops_still_resolve():
    guarded_ops.define_on_lookup()
    import inductor_ext.gated_gather  # noqa: F401  (defines gdn_pass::gated_gather)

    assert torch.ops.gdn_pass.gated_gather.default is not None


# --- the guarded op calls vLLM's function without a second trip through the dispatcher ---

def _stand_in_op(name: str, function, monkeypatch):
    """``gdnpasstest::<name>`` registered with ``function`` as its CPU implementation, from a module of that
    namespace (as vLLM registers its core ops), and the spec the pass would match it with. Each test
    has an op name of its own: a guarded op is named after the op, once per process."""
    import types

    from gdn_pass.opaque_ops import OpaqueStateOp

    module = types.ModuleType(f"gdnpasstest.{name}_layers")
    setattr(module, name, function)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    lib = torch.library.Library("gdnpasstest", "FRAGMENT")
    lib.define(f"{name}(Tensor x, Tensor(a!) out, str layer_name) -> ()")
    lib.impl(name, function, "CPU")
    spec = OpaqueStateOp(f"gdnpasstest::{name}", ("x", "out", "layer_name"))
    return getattr(torch.ops.gdnpasstest, name).default, spec, lib


def _ops_run(fn) -> list[str]:
    """The dispatcher ops the profiler saw while ``fn`` ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [event.name for event in prof.events()]


def _guard_seen(monkeypatch) -> list[str]:
    seen: list[str] = []
    # The guard's layer, with the op's family where it is not GDN's.
    monkeypatch.setattr(guarded_ops, "zero_fresh_state",
                        lambda layer, family: seen.append(layer if family == "gdn" else (layer, family)))
    return seen


def test_guarded_op_runs_the_guard_then_vllms_function_in_one_dispatch(monkeypatch):
    seen = _guard_seen(monkeypatch)

    def direct_core(x, out, layer_name):
        out.copy_(x + 1)

    op, spec, _lib = _stand_in_op("direct_core", direct_core, monkeypatch)
    assert guarded_ops.registered_function(op) is direct_core
    guarded = guarded_ops.guarded_overload(op, spec)
    x, out = torch.arange(4.0), torch.zeros(4)
    names = _ops_run(lambda: guarded(x, out, "model.layers.3.linear_attn"))
    assert seen == ["model.layers.3.linear_attn"]
    assert torch.equal(out, x + 1)  # the original's function ran, with the guarded op's arguments
    assert "gdn_pass::guarded_direct_core" in names
    # The original op is not dispatched a second time (about 4.5 us per call on a CPU host).
    assert "gdnpasstest::direct_core" not in names, names


def test_guarded_op_dispatches_the_original_where_its_function_is_not_certain(monkeypatch):
    seen = _guard_seen(monkeypatch)

    def unsure_core(x, out, layer_name):
        out.copy_(x * 2)

    def renamed(x, out, name):  # same name, other parameters: not the op's function for certain
        raise AssertionError("called a function that is not the op's")

    op, spec, _lib = _stand_in_op("unsure_core", unsure_core, monkeypatch)
    renamed.__name__ = "unsure_core"
    monkeypatch.setattr(sys.modules["gdnpasstest.unsure_core_layers"], "unsure_core", renamed)
    assert guarded_ops.registered_function(op) is None
    guarded = guarded_ops.guarded_overload(op, spec)
    x, out = torch.arange(4.0), torch.zeros(4)
    names = _ops_run(lambda: guarded(x, out, "model.layers.0.linear_attn"))
    assert seen == ["model.layers.0.linear_attn"] and torch.equal(out, x * 2)
    assert "gdnpasstest::unsure_core" in names  # through the dispatcher, as before


def test_two_functions_of_the_op_name_are_not_taken(monkeypatch):
    import types

    def two_core(x, out, layer_name):
        pass

    op, _spec, _lib = _stand_in_op("two_core", two_core, monkeypatch)
    assert guarded_ops.registered_function(op) is two_core
    again = types.ModuleType("gdnpasstest.reexports")  # the same function imported elsewhere: still one
    again.two_core = two_core
    monkeypatch.setitem(sys.modules, again.__name__, again)
    assert guarded_ops.registered_function(op) is two_core
    other = types.ModuleType("gdnpasstest.other")

    def two_core(x, out, layer_name):  # noqa: F811 - another function of the same name and parameters
        pass

    other.two_core = two_core
    monkeypatch.setitem(sys.modules, other.__name__, other)
    assert guarded_ops.registered_function(op) is None


def test_vllm_core_ops_resolve_to_the_functions_vllm_registered():
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    gdn_attention.register_cpu_gdn_attention_ops()
    expected = {torch.ops.vllm.cpu_gdn_attention_core.default: gdn_attention.cpu_gdn_attention_core}
    try:
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as qwen
    except ImportError:  # releases before the gdn/ package: the CPU op above
        qwen = None
    if qwen is not None:
        expected[torch.ops.vllm.qwen_gdn_attention_core.default] = qwen.qwen_gdn_attention_core
    for op, function in expected.items():
        assert guarded_ops.registered_function(op) is function, op
