"""Bailing-MoE-v3's KDA core op, guarded with poisoned state slots.

vLLM's CPU backend cannot run Bailing-MoE-v3 (see the family's CPU_LIMITS
entry): its engine configuration is rejected, its fp32 short-conv weights hit
a bf16-only CPU prepack, and every KDA kernel it calls (``fused_kda_gate``,
``chunk_kda``, ``fused_recurrent_kda``) is Triton-only. So the op is guarded
here directly, with vLLM's real op ``vllm::bailing_v3_kda_attention``: the op
itself runs (it looks the layer up in the forward context and calls
``layer._forward``), but the layer is a stand-in whose ``_forward``, instead
of launching the Triton kernels, records the layer's caches as the kernels
would have found them. That record must show the fresh row's slot already
zero and every other slot (the decoding row's history, padding, unused
slots) bit-identical to before. Without the guard the same record shows the
previous owner's poison, so the test fails if the guard does nothing.

Cache shapes and dtypes come from vLLM's own ``kda_state_shape`` /
``kda_state_dtype``, which Bailing's layer uses for its kv_cache.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.fx import Graph, GraphModule

import gdn_pass
import vllm.forward_context
import vllm.model_executor.models.bailing_moe_v3 as bailing  # registers the op
from harness.coverage import record
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS, schema_mismatch
from gdn_pass.vllm import VllmGDNStatePass
from gdn_pass.vllm.guarded_ops import guarded_overload
from gdn_pass.vllm.handoff import StepHandoff, attach
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)

OP = torch.ops.vllm.bailing_v3_kda_attention.default
SPEC = KNOWN_OPAQUE_STATE_OPS["vllm::bailing_v3_kda_attention"]
AUTO_FUNC = torch.ops.higher_order.auto_functionalized
LAYER = "model.layers.0.self_attn"
HEADS, HEAD_DIM, WIDTH, NUM_SLOTS = 2, 16, 4, 10
DECODE_SLOT, FRESH_SLOT, IDLE_PAD_SLOT = 3, 5, 2


class RecordingKDALayer:
    """Stands in for BailingMoeV3KimiDeltaAttention: ``_forward`` records the caches."""

    def __init__(self):
        conv_shape, ssm_shape = MambaStateShapeCalculator.kda_state_shape(
            1, HEADS, HEAD_DIM, conv_kernel_size=WIDTH, num_spec=0)
        conv_dtype, ssm_dtype = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto")
        # Every slot holds a previous owner's state: NaN conv windows, large recurrent state.
        conv = torch.full((NUM_SLOTS, *conv_shape), float("nan"), dtype=conv_dtype)
        ssm = torch.arange(NUM_SLOTS, dtype=ssm_dtype).view(-1, 1, 1, 1) + 100.0
        self.kv_cache = (conv, ssm.expand(NUM_SLOTS, *ssm_shape).contiguous())
        self.prefix = LAYER
        self.seen: list[tuple[torch.Tensor, ...]] = []

    def _forward(self, q_proj_states, k_proj_states, v_proj_states, g1, beta, core_attn_out):
        self.seen.append(tuple(c.clone() for c in self.kv_cache))
        core_attn_out.fill_(1.0)  # the op's only output: shows it ran


def staged_rows() -> StagedRowMetadata:
    """All rows one token (the bug's trigger): decode, fresh on a dirty slot, two paddings."""
    rows = StagedRowMetadata(8, pad_slot_ids=(-1, 0))
    rows.stage(
        num_computed_tokens=torch.tensor([7, 0, 0, 0]),
        query_lens=torch.tensor([1, 1, 1, 0]),
        state_slots=torch.tensor([DECODE_SLOT, FRESH_SLOT, -1, IDLE_PAD_SLOT]),
    )
    return rows


@pytest.fixture
def layer(monkeypatch):
    layer = RecordingKDALayer()
    context = SimpleNamespace(
        no_compile_layers={LAYER: layer},
        attn_metadata={LAYER: attach(SimpleNamespace(), StepHandoff(staged_rows()))},
    )
    # the guard and vLLM's op each look the forward context up
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    monkeypatch.setattr(bailing, "get_forward_context", lambda: context)
    return layer


def op_inputs(tokens: int = 4):
    gen = torch.Generator().manual_seed(0)
    proj = HEADS * HEAD_DIM
    q, k, v = (torch.randn(tokens, proj, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    g1 = torch.randn(1, tokens, HEADS, HEAD_DIM, generator=gen)
    beta = torch.rand(1, tokens, HEADS, generator=gen)
    out = torch.zeros(1, tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    return q, k, v, g1, beta, out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN included."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_registry_matches_vllm_schema():
    assert schema_mismatch(OP, SPEC) is None, str(OP._schema)


def test_guarded_op_zeroes_fresh_slot_before_kda(layer):
    before = tuple(c.clone() for c in layer.kv_cache)
    guarded = guarded_overload(OP, SPEC)
    assert guarded.name() == "gdn_pass::guarded_bailing_v3_kda_attention"
    q, k, v, g1, beta, out = op_inputs()
    torch.ops.gdn_pass.guarded_bailing_v3_kda_attention(q, k, v, g1, beta, out, LAYER)

    (seen,) = layer.seen  # the original op ran, once, after the guard
    assert out.eq(1.0).all()
    for cache, old in zip(seen, before):
        assert cache[FRESH_SLOT].eq(0).all(), "fresh row would read the previous owner's state"
        others = [s for s in range(NUM_SLOTS) if s != FRESH_SLOT]
        assert same(cache[others], old[others]), "history / padding / unused slots changed"
    record("bailing_moe_v3", "core op, poisoned slots", status="op_guard",
           detail="vllm::bailing_v3_kda_attention: fresh slot zeroed (conv+recurrent), "
                  "history slots bit-identical")


def test_unguarded_op_reads_the_poison(layer):
    """Negative control: vLLM's op alone hands the fresh row the previous owner's state."""
    OP(*op_inputs(), LAYER)
    conv, ssm = layer.seen[0]
    assert conv[FRESH_SLOT].isnan().all()
    assert ssm[FRESH_SLOT].eq(100.0 + FRESH_SLOT).all()


def test_pass_swaps_the_op_in_a_post_grad_graph():
    g = Graph()
    args = [g.placeholder(n) for n in ("q", "k", "v", "g1", "beta")]
    for i in range(3):
        out = g.placeholder(f"out{i}")
        node = g.call_function(AUTO_FUNC, (OP,), dict(
            q_proj_states=args[0], k_proj_states=args[1], v_proj_states=args[2], g1=args[3],
            beta=args[4], core_attn_out=out, layer_name=f"model.layers.{i}.self_attn"))
    g.output(node)
    GraphModule(torch.nn.Module(), g)
    gdn_pass.clear_reports()
    VllmGDNStatePass()(g)
    swapped = [n.args[0].name() for n in g.nodes if n.target is AUTO_FUNC]
    assert swapped == ["gdn_pass::guarded_bailing_v3_kda_attention"] * 3
    (report,) = gdn_pass.reports()
    assert report.guarded_per_op() == {"vllm::bailing_v3_kda_attention": 3}


def test_compiled_graph_runs_the_guard(layer):
    """Through Inductor (functionalization, reinplacing, fallback kernel) with the pass."""

    def step(q, k, v, g1, beta):
        out = torch.zeros(1, q.shape[0], HEADS, HEAD_DIM, dtype=torch.bfloat16)
        OP(q, k, v, g1, beta, out, LAYER)
        return out + 1

    before = tuple(c.clone() for c in layer.kv_cache)
    gdn_pass.clear_reports()
    compiled = torch.compile(step, backend="inductor", fullgraph=True,
                             options={"post_grad_custom_post_pass": VllmGDNStatePass()})
    # compile for real, so that the pass runs (and reports) in this process
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        result = compiled(*op_inputs()[:5])
    assert result.eq(2.0).all()
    assert any(r.guarded_per_op() == {"vllm::bailing_v3_kda_attention": 1} for r in gdn_pass.reports())
    conv, ssm = layer.seen[-1]
    assert conv[FRESH_SLOT].eq(0).all() and ssm[FRESH_SLOT].eq(0).all()
    assert same(ssm[DECODE_SLOT], before[1][DECODE_SLOT]) and same(conv[DECODE_SLOT], before[0][DECODE_SLOT])
