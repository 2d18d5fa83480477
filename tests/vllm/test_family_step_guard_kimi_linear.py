"""Standalone Kimi-Linear: no graph, no op, so the step guard zeroes its KDA state (vLLM 0.30).

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
puts its KDA core behind an op fails here. No graph pass can reach such a read;
the step guard does: in an engine with GDNStatePass configured and compilation
mode NONE, the metadata hook zeroes the fresh rows' slots of every layer of the
builder's group when the step's metadata is built, before ``_forward`` runs.
The last test drives a real GDN builder over Kimi's cache layout (packed
q/k/v conv window, fp32 recurrent state; shapes from vLLM's ``kda_state_shape``
that ``KimiLinearForCausalLM`` uses) with poisoned slots.
"""

import dataclasses
import inspect
from types import SimpleNamespace

import torch

from harness.coverage import record
from harness.families.kimi_linear import KIMI_LINEAR_CONFIG
from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS
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

from test_metadata_hook import common_metadata  # noqa: E402

NUM_SLOTS = 10


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


def kimi_layer(prefix):
    kda = KIMI_LINEAR_CONFIG["linear_attn_config"]
    conv_shape, ssm_shape = MambaStateShapeCalculator.kda_state_shape(
        1, kda["num_heads"], kda["head_dim"], conv_kernel_size=kda["short_conv_kernel_size"], num_spec=0)
    conv_dtype, ssm_dtype = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto")
    conv = torch.full((NUM_SLOTS, *conv_shape), float("nan"), dtype=conv_dtype)
    ssm = (torch.arange(NUM_SLOTS, dtype=ssm_dtype).view(-1, 1, 1, 1) + 100.0).expand(
        NUM_SLOTS, *ssm_shape).contiguous()
    return SimpleNamespace(prefix=prefix, kv_cache=[conv, ssm])


def test_step_guard_zeroes_kimi_state_at_metadata_build(monkeypatch):
    """Mode NONE, as Kimi-Linear's architecture forces: the step guard owns the group."""
    from test_step_guard import engine

    from gdn_pass.vllm import metadata_hook, step_guard

    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())
    names = [f"model.layers.{i}.self_attn" for i in range(3)]
    builder, layers = engine(monkeypatch, compiled=False, new_layer=kimi_layer, layer_names=names)
    before = {n: [t.clone() for t in layer.kv_cache] for n, layer in layers.items()}
    # one-token rows: decode on block 3, brand new on dirty block 5, padding row (zero query)
    common = dataclasses.replace(
        common_metadata([7, 0, 0], [1, 1, 0]),
        block_table_tensor=torch.tensor([[3], [5], [0]], dtype=torch.int32))
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
    assert metadata.num_prefills == 0 and metadata.has_initial_state is None, "vLLM calls it a decode"
    assert metadata_hook.state_of(builder).owner is step_guard.Owner.STEP

    others = [s for s in range(NUM_SLOTS) if s != 5]
    for name, layer in layers.items():
        for cache, old in zip(layer.kv_cache, before[name]):
            assert cache[5].eq(0).all()
            assert torch.equal(cache[others].isnan(), old[others].isnan())
            assert torch.equal(cache[others].nan_to_num(), old[others].nan_to_num())
    record("kimi_linear", "KDA read in Python, mode NONE (poisoned slots)", status="note",
           cell="guarded (step guard)",
           detail="vLLM 0.30 runs Kimi-Linear without a compiled graph and reads KDA state behind "
                  "no op; a real GDN builder in mode NONE zeroes the fresh slot of every layer's "
                  "conv and recurrent state at metadata build, other slots bit-identical")
