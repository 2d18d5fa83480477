"""The fused alternative's gated decode kernels against vLLM's own decode kernels, on CUDA, at Qwen3-Next's dimensions.

``benchmarks/fused_decode.py`` replaces vLLM 0.26's ``causal_conv1d_update``
and ``fused_recurrent_gated_delta_rule_packed_decode`` on the decode fast
path. Rows that have state must decode as vLLM's kernels decode them; new
rows (``seq_len == query_len``) sit on poisoned slots and must decode as
vLLM's kernels do on a zeroed slot. Skips without CUDA or vLLM.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
vllm_conv = pytest.importorskip("vllm.model_executor.layers.mamba.ops.causal_conv1d")
vllm_fla = pytest.importorskip("vllm.third_party.flash_linear_attention.ops.fused_recurrent")

from benchmarks.fused_decode import gated_conv1d_update, gated_packed_decode  # noqa: E402

H, HV, K, V, WIDTH, SLOTS = 16, 32, 128, 128, 4, 300
DIM = 2 * H * K + HV * V


@pytest.mark.parametrize("rows", [1, 8, 64, 256])
@pytest.mark.parametrize("graph", [False, True])
def test_gated_kernels_decode_as_vllms_and_new_rows_as_on_a_zeroed_slot(rows, graph):
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    slots = (torch.randperm(SLOTS - 1, device="cuda", generator=gen)[:rows] + 1).to(torch.int32)
    new = torch.rand(rows, device="cuda", generator=gen) < 0.5
    query_lens = torch.ones(rows, dtype=torch.int32, device="cuda")
    seq_lens = torch.where(new, query_lens, torch.randint(2, 500, (rows,), device="cuda", generator=gen,
                                                          dtype=torch.int32))
    starts = torch.zeros(rows + 1, dtype=torch.int32, device="cuda")
    starts[1:] = query_lens.cumsum(0)
    x = rand(rows, DIM)
    conv_state = rand(SLOTS, DIM, WIDTH - 1)
    ssm_state = rand(SLOTS, HV, V, K, dtype=torch.float32, scale=0.1)
    weight, bias = rand(DIM, WIDTH, scale=0.5), rand(DIM, scale=0.1)
    a, b = rand(rows, HV), rand(rows, HV)
    A_log, dt_bias = rand(HV, dtype=torch.float32, scale=0.5), rand(HV, dtype=torch.float32, scale=0.5)
    new_slots = slots[new].long()

    # vLLM's kernels on caches whose new rows' slots were zeroed: the reference
    ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
    ref_conv[new_slots], ref_ssm[new_slots] = 0, 0
    ref_out = torch.empty(rows, 1, HV, V, dtype=torch.bfloat16, device="cuda")
    mixed = vllm_conv.causal_conv1d_update(x.clone(), ref_conv, weight, bias, "silu", conv_state_indices=slots,
                                           validate_data=False)
    vllm_fla.fused_recurrent_gated_delta_rule_packed_decode(
        mixed_qkv=mixed, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, initial_state=ref_ssm,
        out=ref_out, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)

    # the gated kernels on caches whose new rows' slots hold poison
    got_conv, got_ssm = conv_state.clone(), ssm_state.clone()
    got_conv[new_slots], got_ssm[new_slots] = 1e4, 1e4
    got_out = torch.empty_like(ref_out)
    x_in = x.clone()

    # The recurrent kernel is fed vLLM's conv output: the two conv kernels round their
    # bf16 outputs apart by an ulp here and there, which the recurrence would carry on.
    mixed_ref = mixed.clone()

    def step():
        gated_conv1d_update(x_in, got_conv, weight, bias, "silu", slots, starts, seq_lens)
        gated_packed_decode(mixed_ref, a, b, A_log, dt_bias, K ** -0.5, got_ssm, got_out, slots, starts, seq_lens)

    if graph:  # captured, as under vLLM's FULL decode graphs
        warm_conv, warm_ssm, warm_x = got_conv.clone(), got_ssm.clone(), x_in.clone()
        step()  # compile outside capture, then restore what the warm-up wrote
        got_conv.copy_(warm_conv), got_ssm.copy_(warm_ssm), x_in.copy_(warm_x)
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            step()
        captured.replay()
    else:
        step()
    torch.cuda.synchronize()
    # conv: outputs and windows within a bf16 ulp of vLLM's
    torch.testing.assert_close(x_in.float(), mixed.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_conv[slots.long()].float(), ref_conv[slots.long()].float(), atol=0, rtol=0)
    # recurrence, from the same input: vLLM's numbers up to float32 rounding
    torch.testing.assert_close(got_out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_ssm[slots.long()], ref_ssm[slots.long()], atol=1e-5, rtol=1e-4)
    untouched = torch.ones(SLOTS, dtype=torch.bool, device="cuda")
    untouched[slots.long()] = False
    assert torch.equal(got_conv[untouched], conv_state[untouched])
    assert torch.equal(got_ssm[untouched], ssm_state[untouched])
