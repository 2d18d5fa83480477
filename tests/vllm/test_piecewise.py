"""VLLM_COMPILE modes. Piecewise: GDN core ops are splitting ops, outside every
compiled graph, so the guard must apply in vLLM's stitching submodules. Full
graph (``splitting_ops=[]``, what FULL CUDA graphs use) and Inductor graph
partition: the op stays inside the one graph Inductor compiles, where the
post-grad pass guards it.

Driven on CPU through vLLM's own compile backend (VllmBackend via
@support_torch_compile), as vLLM's tests/compile do. The CPU platform rewrites
the mode to DYNAMO_TRACE_ONCE, so the test sets VLLM_COMPILE back after the
config is built; backend="eager" because vLLM's post-grad utilities need CUDA
ops. The splitting op is a test op registered as a known GDN core op: it adds
the layer's recurrent state at the row's slot to its input, so a stale slot
shows in the output.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import gdn_pass
from gdn_pass import opaque_ops
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm import VllmGDNStatePass, install
from gdn_pass.vllm.handoff import StepHandoff, attach
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, VllmConfig, set_current_vllm_config
from vllm.forward_context import get_forward_context, set_forward_context

OP = "vllm::gdn_pass_test_core"
TEST_OP_ROW = "any GDN core op (test op)"
LAYER = "model.layers.0.linear_attn"
SLOT = 3

_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define("gdn_pass_test_core(Tensor x, Tensor(a!) out, str layer_name) -> ()")


def _core(x, out, layer_name):
    context = get_forward_context()
    layer = context.no_compile_layers[layer_name]
    slot = int(context.attn_metadata[layer.prefix].state_slot)
    out.copy_(x + layer.kv_cache[1][slot].sum())


_lib.impl("gdn_pass_test_core", _core, "CPU")
_lib._register_fake("gdn_pass_test_core", lambda x, out, layer_name: None)


@support_torch_compile
class TinyGDNModel(nn.Module):
    def __init__(self, *, vllm_config, prefix="", **kwargs):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        out = torch.empty_like(y)
        torch.ops.vllm.gdn_pass_test_core(y, out, LAYER)
        return out + 1


def piecewise_config(guard: bool, *, splitting_ops=(OP,), graph_partition=False,
                     backend="eager") -> VllmConfig:
    inductor = {"post_grad_custom_post_pass": VllmGDNStatePass()} if guard else {}
    config = VllmConfig(compilation_config=CompilationConfig(
        splitting_ops=list(splitting_ops), use_inductor_graph_partition=graph_partition,
        cudagraph_mode=CUDAGraphMode.NONE, inductor_compile_config=inductor))
    cc = config.compilation_config
    cc.mode, cc.backend, cc.compile_sizes = CompilationMode.VLLM_COMPILE, backend, []
    for name, value in vars(cc.pass_config).items():
        if isinstance(value, bool):
            setattr(cc.pass_config, name, False)  # fusion passes that need CUDA
    return config


@pytest.fixture
def known_test_op(monkeypatch):
    monkeypatch.setitem(opaque_ops.KNOWN_OPAQUE_STATE_OPS, OP,
                        opaque_ops.OpaqueStateOp(OP, ("x", "out", "layer_name")))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    install()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run_fresh_row_on_stale_slot(config: VllmConfig) -> torch.Tensor:
    with set_current_vllm_config(config):
        model = TinyGDNModel(vllm_config=config, prefix="")
    conv = torch.zeros(8, 2, 3)
    ssm = torch.zeros(8, 2, 4, 4)
    ssm[SLOT] = 6.0  # previous owner's state
    layer = SimpleNamespace(prefix=LAYER, kv_cache=(conv, ssm))
    config.compilation_config.static_forward_context[LAYER] = layer
    rows = StagedRowMetadata(4, pad_slot_ids=(-1,))
    rows.stage(num_computed_tokens=torch.tensor([0]), query_lens=torch.tensor([1]),
               state_slots=torch.tensor([SLOT]))  # a brand-new request
    metadata = attach(SimpleNamespace(state_slot=SLOT), StepHandoff(rows))
    with set_forward_context({LAYER: metadata}, config):
        return model(torch.ones(4))


def test_splitting_op_is_guarded_in_the_stitching_graph(known_test_op):
    gdn_pass.clear_reports()
    out = run_fresh_row_on_stale_slot(piecewise_config(guard=True))
    torch.testing.assert_close(out, torch.full((4,), 3.0))  # 2*1 + zero state + 1
    guarded = [r for rep in gdn_pass.reports() for r in rep.reads if r.action == "guarded_op"]
    assert [(r.op, r.layer) for r in guarded] == [(OP, LAYER)]
    from harness.coverage import record

    record(TEST_OP_ROW, "VLLM_COMPILE piecewise", status="note", cell="guarded (stitching graph)",
           detail="the stale slot leaks without the pass; vLLM's backend driven on CPU with a test core op")


def test_without_the_pass_the_stale_slot_leaks(known_test_op):
    out = run_fresh_row_on_stale_slot(piecewise_config(guard=False))
    torch.testing.assert_close(out, torch.full((4,), 3.0 + 6.0 * 32))


@pytest.fixture
def inductor_on_cpu(monkeypatch):
    """vLLM's FixFunctionalizationPass looks up CUDA-only ``torch.ops._C`` ops
    (rotary_embedding, fused_add_rms_norm, ...) that vLLM's CPU build lacks, as
    soon as a graph holds an auto_functionalized node. It only rewrites those
    ops, so on CPU it is skipped and Inductor defunctionalizes the rest itself."""
    from vllm.compilation.passes.utility import fix_functionalization

    monkeypatch.setattr(fix_functionalization.FixFunctionalizationPass, "__call__",
                        lambda self, graph: None)


FULL_GRAPH_MODES = {
    "splitting_ops=[]": dict(splitting_ops=()),
    "inductor_graph_partition": dict(splitting_ops=(OP,), graph_partition=True),
}


@pytest.mark.parametrize("mode", FULL_GRAPH_MODES)
@pytest.mark.parametrize("guard", [False, True])
def test_full_graph_modes_guard_inside_the_one_graph(known_test_op, inductor_on_cpu, mode, guard):
    from harness.coverage import record

    gdn_pass.clear_reports()
    config = piecewise_config(guard, backend="inductor", **FULL_GRAPH_MODES[mode])
    out = run_fresh_row_on_stale_slot(config)
    guarded = [r for rep in gdn_pass.reports() for r in rep.reads if r.action == "guarded_op"]
    if not guard:
        torch.testing.assert_close(out, torch.full((4,), 3.0 + 6.0 * 32))  # stale state leaks
        assert not guarded
        return
    torch.testing.assert_close(out, torch.full((4,), 3.0))
    assert [(r.op, r.layer, r.node.startswith("auto_functionalized")) for r in guarded] == [
        (OP, LAYER, True)]
    record(TEST_OP_ROW, f"VLLM_COMPILE {mode}", status="note", cell="guarded (in the graph)",
           detail="the stale slot leaks without the pass; vLLM's backend + Inductor on CPU, test core op")


def test_a_plugin_not_loaded_before_the_split_leaves_the_split_ops_to_the_step_guard(
        known_test_op, inductor_on_cpu, monkeypatch):
    """Without the entry point (VLLM_PLUGINS set without gdn_pass, or gdn-pass not pip-installed),
    the pass installs the plugin's hooks itself when Inductor first runs it, on a piece: vLLM has
    split the graph by then, and the stitching submodule calls the op unguarded (here the stale
    slot leaks: no builder's step guard runs in this test). The process records it, so that the
    first build says why its groups fall to the step guard (``test_step_guard``)."""
    from gdn_pass.vllm import piecewise

    backends = piecewise._backends()
    monkeypatch.setattr(backends, "split_graph", backends.split_graph.__wrapped__)
    monkeypatch.setattr(backends.VllmBackend, "__call__", backends.VllmBackend.__call__.__wrapped__)
    monkeypatch.setattr(piecewise, "_AFTER_A_SPLIT", [False])
    out = run_fresh_row_on_stale_slot(piecewise_config(True, backend="inductor"))
    torch.testing.assert_close(out, torch.full((4,), 3.0 + 6.0 * 32))  # split out before the guard
    assert piecewise.installed_after_a_split() and piecewise.is_installed()
    out = run_fresh_row_on_stale_slot(piecewise_config(True, backend="inductor"))  # a later engine's split
    torch.testing.assert_close(out, torch.full((4,), 3.0))
