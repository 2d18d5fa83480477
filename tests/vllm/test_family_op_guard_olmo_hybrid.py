"""OLMo-hybrid's GDN op, guarded with poisoned state slots.

vLLM's CPU backend cannot run OLMo-hybrid (see the family's CPU_LIMITS entry):
``OlmoHybridGatedDeltaNetAttention.__init__`` calls ``set_triton_allocator``,
and the CPU build's Triton placeholder has no ``set_allocator``. Past that,
the layer has no CPU path at all: its gating kernel
(``fused_olmo_hybrid_gdn_gating``) and recurrences (``chunk_gated_delta_rule``,
``fused_recurrent_gated_delta_rule``) are Triton-only, unlike the Qwen GDN
layer, which dispatches to ``vllm::cpu_gdn_attention_core`` on CPU.

So the op is guarded here directly, with vLLM's real op
``vllm::olmo_hybrid_gdn_full_forward(hidden_states, output, layer_name)``:
the op itself runs (it looks the layer up in the forward context and calls
``layer._full_forward``), but the layer is a stand-in whose ``_full_forward``
does what vLLM's decode path does without Triton: it first records the caches
as the kernels would find them, then runs the conv update and the gated delta
rule in plain torch (``gdn_pass.checker.torch_gdn``) on the rows vLLM's
builder classified as decodes, reading and writing their state slots.

The step is the bug's trigger: every row has one token, one of them a brand
new request on a recycled, poisoned slot, plus a padding row. The rows are
staged from vLLM's CommonAttentionMetadata by the metadata hook's own
rows (``gdn_pass.vllm.builders.gdn.gdn_rows``), every buffer. Checks: the record shows the fresh slot zero and every other
slot bit-identical; the op's output equals a reference run on clean state
(fresh row from zero, decode row from its history); without the guard the
same op reads the poison, so the test can fail.
"""

from types import SimpleNamespace

import torch
from torch.fx import Graph, GraphModule

import gdn_pass
import vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn  # noqa: F401  registers the op
from harness.coverage import record
from gdn_pass.checker.torch_gdn import GDNShape, TorchGDNLayer
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS, schema_mismatch
from gdn_pass.vllm import VllmGDNStatePass, compat
from gdn_pass.vllm.guarded_ops import guarded_overload
from gdn_pass.vllm.handoff import StepHandoff, attach, handoff_of
from gdn_pass.vllm.builders.gdn import gdn_rows
from vllm.forward_context import get_forward_context, override_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.v1.attention.backend import CommonAttentionMetadata

OP = torch.ops.vllm.olmo_hybrid_gdn_full_forward.default
SPEC = KNOWN_OPAQUE_STATE_OPS["vllm::olmo_hybrid_gdn_full_forward"]
AUTO_FUNC = torch.ops.higher_order.auto_functionalized
LAYER = "model.layers.0.linear_attn"
SHAPE = GDNShape(hidden=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel=4)
NUM_SLOTS = 10
DECODE_SLOT, FRESH_SLOT = 3, 5
PAD_SLOT = compat.pad_slot_ids()[-1]  # what this vLLM writes for a padding row
HISTORY = 9  # tokens the decoding row computed before this step


def vllm_caches() -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (conv, recurrent) caches with the shapes and dtypes OLMo's layer gets from vLLM."""
    conv_shape, ssm_shape = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, SHAPE.num_k_heads, SHAPE.num_v_heads, SHAPE.head_k_dim, SHAPE.head_v_dim,
        SHAPE.conv_kernel, 0)
    conv_dtype, ssm_dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        torch.bfloat16, "auto", "auto")
    return (torch.zeros(NUM_SLOTS, *conv_shape, dtype=conv_dtype),
            torch.zeros(NUM_SLOTS, *ssm_shape, dtype=ssm_dtype))


def conv_dim_first(conv: torch.Tensor) -> torch.Tensor:
    # As OLMo's _forward_core: the kernels want (..., dim, width - 1).
    return conv if is_conv_state_dim_first() else conv.transpose(-1, -2)


def history_state() -> tuple[torch.Tensor, torch.Tensor]:
    """The decoding row's real state: its layer state after a few tokens from zero."""
    gdn = TorchGDNLayer(SHAPE, seed=1, dtype=torch.bfloat16)
    conv, ssm = vllm_caches()
    tokens = torch.randn(1, HISTORY, SHAPE.hidden, generator=torch.Generator().manual_seed(2))
    gdn(tokens.to(torch.bfloat16), conv_dim_first(conv), ssm, torch.tensor([DECODE_SLOT]))
    return conv[DECODE_SLOT].clone(), ssm[DECODE_SLOT].clone()


class StandInOlmoGDN:
    """Stands in for OlmoHybridGatedDeltaNetAttention; ``_full_forward`` runs a torch decode."""

    def __init__(self, poisoned: bool):
        self.prefix = LAYER
        self.gdn = TorchGDNLayer(SHAPE, seed=0, dtype=torch.bfloat16)
        conv, ssm = vllm_caches()
        if poisoned:  # every slot holds a previous owner's state
            conv.fill_(float("nan"))
            ssm.copy_((torch.arange(NUM_SLOTS) + 100.0).view(-1, 1, 1, 1).expand_as(ssm))
        conv[DECODE_SLOT], ssm[DECODE_SLOT] = history_state()
        self.kv_cache = (conv, ssm)
        self.seen: list[tuple[torch.Tensor, ...]] = []

    def _full_forward(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        self.seen.append(tuple(c.clone() for c in self.kv_cache))
        md = get_forward_context().attn_metadata[self.prefix]
        # vLLM's decode path: rows [:num_decodes] read and write their slots unconditionally.
        n = md.num_decodes
        slots = md.non_spec_state_indices_tensor[:n]
        conv, ssm = self.kv_cache
        out = self.gdn(hidden_states[:n, None], conv_dim_first(conv), ssm, slots)
        output[:n] = out[:, 0]


def step_metadata() -> SimpleNamespace:
    """The bug's step: decode, fresh one-token row on a recycled slot, one padding row.

    GDN metadata as vLLM 0.30's builder leaves it for this step (both real rows
    decodes, no prefill, so no has_initial_state), with the rows staged by the
    metadata hook from the scheduler's CommonAttentionMetadata.
    """
    computed, qlens = [HISTORY, 0, 0], [1, 1, 0]
    qsl = torch.tensor([0, *qlens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(computed, dtype=torch.int32) + torch.tensor(qlens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
        num_reqs=3, num_actual_tokens=2, max_query_len=1, max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros(3, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(2, dtype=torch.int64), seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    md = SimpleNamespace(
        num_decodes=2, num_prefills=0, has_initial_state=None, spec_sequence_masks=None,
        non_spec_state_indices_tensor=torch.tensor([DECODE_SLOT, FRESH_SLOT, PAD_SLOT], dtype=torch.int32),
    )
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    gdn_rows(common, md).stage(rows)
    return attach(md, StepHandoff(rows))


def context_for(layer: StandInOlmoGDN) -> SimpleNamespace:
    return SimpleNamespace(no_compile_layers={LAYER: layer}, attn_metadata={LAYER: step_metadata()})


def op_inputs(tokens: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = torch.randn(tokens, SHAPE.hidden, generator=torch.Generator().manual_seed(3))
    return hidden.to(torch.bfloat16), torch.zeros(tokens, SHAPE.hidden, dtype=torch.bfloat16)


def reference(hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Output and caches of the same step on clean caches: the fresh slot was never used."""
    layer = StandInOlmoGDN(poisoned=False)
    out = torch.zeros_like(hidden)
    with override_forward_context(context_for(layer)):
        layer._full_forward(hidden, out)
    return out, layer.kv_cache


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN included."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_registry_matches_vllm_schema():
    assert schema_mismatch(OP, SPEC) is None, str(OP._schema)
    guarded = guarded_overload(OP, SPEC)
    assert guarded.name() == "gdn_pass::guarded_olmo_hybrid_gdn_full_forward"
    assert [(a.name, str(a.type), a.is_write) for a in guarded._schema.arguments] == [
        (a.name, str(a.type), a.is_write) for a in OP._schema.arguments]


def test_rows_staged_as_the_bug_needs():
    rows = handoff_of(step_metadata()).rows
    assert rows.fresh_slots().tolist() == [FRESH_SLOT]
    assert rows.valid[:3].tolist() == [True, True, False]


def test_guarded_op_zeroes_fresh_slot_and_matches_clean_state():
    layer = StandInOlmoGDN(poisoned=True)
    before = tuple(c.clone() for c in layer.kv_cache)
    guarded_overload(OP, SPEC)
    hidden, out = op_inputs()
    with override_forward_context(context_for(layer)):
        torch.ops.gdn_pass.guarded_olmo_hybrid_gdn_full_forward(hidden, out, LAYER)

    (seen,) = layer.seen  # the original op ran, once, after the guard
    others = [s for s in range(NUM_SLOTS) if s != FRESH_SLOT]
    for cache, old in zip(seen, before):
        assert cache[FRESH_SLOT].eq(0).all(), "fresh row would read the previous owner's state"
        assert same(cache[others], old[others]), "history / padding / unused slots changed"

    ref_out, ref_caches = reference(hidden)
    assert out[:2].isfinite().all()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for cache, ref in zip(layer.kv_cache, ref_caches):
        for slot in (DECODE_SLOT, FRESH_SLOT):  # both rows wrote back the clean run's state
            assert same(cache[slot], ref[slot])
    record("olmo_hybrid", "core op, poisoned slots", status="op_guard",
           detail="vllm::olmo_hybrid_gdn_full_forward: fresh slot zeroed (conv+recurrent) "
                  "before the op, history bit-identical, output = clean-state reference")


def test_unguarded_op_reads_the_poison():
    """Negative control: vLLM's op alone hands the fresh row the previous owner's state."""
    layer = StandInOlmoGDN(poisoned=True)
    hidden, out = op_inputs()
    with override_forward_context(context_for(layer)):
        OP(hidden, out, LAYER)
    conv, ssm = layer.seen[0]
    assert conv[FRESH_SLOT].isnan().all() and ssm[FRESH_SLOT].eq(100.0 + FRESH_SLOT).all()
    assert not out[1].isfinite().all(), "the NaN conv window must reach the fresh row's output"
    ref_out, _ = reference(hidden)
    assert torch.equal(out[0], ref_out[0]), "the decoding row is not affected"


def test_pass_swaps_the_op_in_a_post_grad_graph():
    g = Graph()
    hidden = g.placeholder("hidden_states")
    for i in range(3):
        out = g.placeholder(f"out{i}")
        node = g.call_function(AUTO_FUNC, (OP,), dict(
            hidden_states=hidden, output=out, layer_name=f"model.layers.{i}.linear_attn"))
    g.output(node)
    GraphModule(torch.nn.Module(), g)
    gdn_pass.clear_reports()
    VllmGDNStatePass()(g)
    swapped = [n.args[0].name() for n in g.nodes if n.target is AUTO_FUNC]
    assert swapped == ["gdn_pass::guarded_olmo_hybrid_gdn_full_forward"] * 3
    (report,) = gdn_pass.reports()
    assert report.guarded_per_op() == {"vllm::olmo_hybrid_gdn_full_forward": 3}
    assert [r.layer for r in report.guarded] == [f"model.layers.{i}.linear_attn" for i in range(3)]


def test_compiled_graph_runs_the_guard():
    """Through Inductor (functionalization, reinplacing, fallback kernel) with the pass."""

    def step(hidden):
        out = torch.empty_like(hidden)  # as OlmoHybridDecoderLayer allocates it
        OP(hidden, out, LAYER)
        return out * 1

    layer = StandInOlmoGDN(poisoned=True)
    hidden, _ = op_inputs()
    gdn_pass.clear_reports()
    compiled = torch.compile(step, backend="inductor", fullgraph=True,
                             options={"post_grad_custom_post_pass": VllmGDNStatePass()})
    with override_forward_context(context_for(layer)):
        out = compiled(hidden)
    assert any(r.guarded_per_op() == {"vllm::olmo_hybrid_gdn_full_forward": 1} for r in gdn_pass.reports())
    conv, ssm = layer.seen[-1]
    assert conv[FRESH_SLOT].eq(0).all() and ssm[FRESH_SLOT].eq(0).all()
    ref_out, _ = reference(hidden)
    torch.testing.assert_close(out[:2], ref_out[:2], rtol=0, atol=0)

