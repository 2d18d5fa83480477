"""Standalone Kimi-Linear: why GDNStatePass cannot reach its KDA state reads in vLLM 0.30.

vLLM's CPU backend cannot run Kimi-Linear (see the family's CPU_LIMITS entry;
its KDA kernels are Triton-only), and unlike Bailing-MoE-v3 there is no op to
guard directly: vLLM 0.30 builds ``KimiLinearForCausalLM`` from
``vllm.models.kimi_k3`` (NVIDIA implementation) with

  * no ``@support_torch_compile`` on the model, and the architecture in
    ``DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES``, which sets the compilation
    mode to NONE: there is no compiled graph for the pass to rewrite;
  * the KDA state read in plain Python (``KimiGatedDeltaNetAttention._forward``,
    decorated ``@eager_break_during_capture``), not behind a custom op.

These tests pin those facts, so a vLLM that starts compiling Kimi-Linear or
puts its KDA core behind an op fails here and the family gets guarded; and
they check that the guard body (``zero_fresh_state``) handles Kimi's cache
layout (packed q/k/v conv window, fp32 recurrent state; shapes from vLLM's
``kda_state_shape`` that ``KimiLinearForCausalLM`` uses) with poisoned slots,
should an eager hook call it before ``_forward``.
"""

import inspect
from types import SimpleNamespace

import torch

import vllm.forward_context
from gdn_pass.examples.coverage import record
from gdn_pass.examples.families.kimi_linear import KIMI_LINEAR_CONFIG
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS
from gdn_pass.vllm.state_guard import ROWS_ATTR, zero_fresh_state
from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from vllm.config.vllm import DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3Model
from vllm.models.kimi_k3 import KimiLinearForCausalLM
from vllm.models.kimi_k3.nvidia.model import KimiLinearModel

NUM_SLOTS = 10
LAYER = "model.layers.0.self_attn"


def test_kimi_linear_has_no_compiled_graph():
    assert KimiLinearForCausalLM.__module__ == "vllm.models.kimi_k3.nvidia.model"
    assert "KimiLinearForCausalLM" in DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES
    # @support_torch_compile adds this base; Bailing's model (compiled) is the control
    assert issubclass(BailingMoeV3Model, TorchCompileWithNoGuardsWrapper)
    assert not issubclass(KimiLinearModel, TorchCompileWithNoGuardsWrapper)


def test_kimi_kda_state_read_is_not_behind_an_op():
    source = inspect.getsource(KimiGatedDeltaNetAttention)
    assert "torch.ops." not in source
    assert not any(spec.split("::")[1] in source for spec in KNOWN_OPAQUE_STATE_OPS)
    # the state is read right in _forward, from the layer's kv_cache
    body = inspect.getsource(KimiGatedDeltaNetAttention._forward)
    assert "self.kv_cache" in body and "fused_recurrent_kda_packed_decode" in body


def test_state_guard_zeroes_kimi_cache_layout(monkeypatch):
    kda = KIMI_LINEAR_CONFIG["linear_attn_config"]
    conv_shape, ssm_shape = MambaStateShapeCalculator.kda_state_shape(
        1, kda["num_heads"], kda["head_dim"], conv_kernel_size=kda["short_conv_kernel_size"], num_spec=0)
    conv_dtype, ssm_dtype = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto")
    conv = torch.full((NUM_SLOTS, *conv_shape), float("nan"), dtype=conv_dtype)
    ssm = (torch.arange(NUM_SLOTS, dtype=ssm_dtype).view(-1, 1, 1, 1) + 100.0).expand(
        NUM_SLOTS, *ssm_shape).contiguous()
    layer = SimpleNamespace(prefix=LAYER, kv_cache=(conv, ssm))
    before = (conv.clone(), ssm.clone())

    # one-token rows: decode on 3, fresh on dirty 5, padding (sentinel), padding (zero query) on 2
    rows = StagedRowMetadata(8, pad_slot_ids=(-1, 0))
    rows.stage(num_computed_tokens=torch.tensor([7, 0, 0, 0]), query_lens=torch.tensor([1, 1, 1, 0]),
               state_slots=torch.tensor([3, 5, -1, 2]))
    context = SimpleNamespace(no_compile_layers={LAYER: layer},
                              attn_metadata={LAYER: SimpleNamespace(**{ROWS_ATTR: rows})})
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    zero_fresh_state(LAYER)

    others = [s for s in range(NUM_SLOTS) if s != 5]
    for cache, old in zip(layer.kv_cache, before):
        assert cache[5].eq(0).all()
        assert torch.equal(cache[others].isnan(), old[others].isnan())
        assert torch.equal(cache[others].nan_to_num(), old[others].nan_to_num())
    record("kimi_linear", "core op, poisoned slots", status="not_guardable",
           detail="vLLM 0.30 runs Kimi-Linear without a compiled graph and its KDA read is "
                  "behind no op: nothing for the pass to rewrite (guard body verified on its "
                  "cache layout)")
