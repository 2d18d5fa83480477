"""Inductor's FX graph cache and the pass: a hit carries the guard, an option change misses.

The graph calls a test op registered as a known GDN core op; the op adds the
layer's recurrent state at the row's slot, so whether the cached graph runs
the guard shows in the output.
"""

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import vllm.forward_context
from gdn_pass import opaque_ops
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm import VllmGDNStatePass
from gdn_pass.vllm.handoff import StepHandoff, attach

OP = "vllm::gdn_pass_cache_test_core"
LAYER = "model.layers.0.linear_attn"
SLOT = 2

_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define("gdn_pass_cache_test_core(Tensor x, Tensor(a!) out, str layer_name) -> ()")


def _core(x, out, layer_name):
    context = vllm.forward_context.get_forward_context()
    layer = context.no_compile_layers[layer_name]
    out.copy_(x + layer.kv_cache[1][SLOT].sum())


_lib.impl("gdn_pass_cache_test_core", _core, "CPU")
_lib._register_fake("gdn_pass_cache_test_core", lambda x, out, layer_name: None)


def model(x):
    out = torch.empty_like(x)
    torch.ops.vllm.gdn_pass_cache_test_core(x * 2, out, LAYER)
    return out + 1


@pytest.fixture
def stale_slot_context(monkeypatch):
    monkeypatch.setitem(opaque_ops.KNOWN_OPAQUE_STATE_OPS, OP,
                        opaque_ops.OpaqueStateOp(OP, ("x", "out", "layer_name")))
    rows = StagedRowMetadata(4, pad_slot_ids=(-1, 0))
    rows.stage(num_computed_tokens=torch.tensor([0]), query_lens=torch.tensor([1]),
               state_slots=torch.tensor([SLOT]))
    layer = SimpleNamespace(prefix=LAYER, kv_cache=(torch.zeros(4, 2), torch.zeros(4, 3)))
    context = SimpleNamespace(no_compile_layers={LAYER: layer},
                              attn_metadata={LAYER: attach(SimpleNamespace(), StepHandoff(rows))})
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    return layer


def compile_and_run(pass_, layer):
    layer.kv_cache[1][SLOT] = 5.0  # a previous owner's state in the fresh row's slot
    torch._dynamo.reset()
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": pass_, "fx_graph_cache": True})
    return compiled(torch.ones(3))


def test_cache_hit_carries_the_guard_and_option_change_misses(stale_slot_context):
    guarded, unguarded = torch.full((3,), 3.0), torch.full((3,), 3.0 + 15.0)
    with fresh_cache():
        counters.clear()
        torch.testing.assert_close(compile_and_run(VllmGDNStatePass(), stale_slot_context), guarded)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1

        counters.clear()
        torch.testing.assert_close(compile_and_run(VllmGDNStatePass(), stale_slot_context), guarded)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])

        counters.clear()
        torch.testing.assert_close(compile_and_run(VllmGDNStatePass(guard_opaque_ops=False), stale_slot_context), unguarded)
        assert counters["inductor"]["fxgraph_cache_hit"] == 0, dict(counters["inductor"])


def test_pass_with_live_metadata_is_not_cached(stale_slot_context):
    rows = StagedRowMetadata(4)
    with fresh_cache():
        counters.clear()
        compile_and_run(VllmGDNStatePass(rows), stale_slot_context)
        compile_and_run(VllmGDNStatePass(rows), stale_slot_context)
        assert counters["inductor"]["fxgraph_cache_hit"] == 0
        assert counters["inductor"]["fxgraph_cache_bypass"] >= 1, dict(counters["inductor"])


def test_pass_also_guards_as_a_joint_graph_pass(stale_slot_context):
    """As ``joint_custom_post_pass`` the rewrite happens before Inductor's post-grad
    FakeTensorUpdater snapshots the graph, so it does not re-propagate fake
    tensors downstream of every rewritten node (benchmarks/compile_time.py)."""
    import gdn_pass

    stale_slot_context.kv_cache[1][SLOT] = 5.0
    torch._dynamo.reset()
    gdn_pass.clear_reports()
    compiled = torch.compile(model, options={"joint_custom_post_pass": VllmGDNStatePass()})
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert [r.action for rep in gdn_pass.reports() for r in rep.reads] == ["guarded_op"]
