"""The fused alternative to the zeroing launch: vLLM's decode fast path with gated state loads. Benchmarks only.

vLLM 0.26's GDN layer runs a step whose rows are all one-token decodes (no
prefill, no speculative row) through ``_forward_core_decode_non_spec``
(``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``): two kernels
that read each row's state slot, ``causal_conv1d_update`` (conv state) and
``fused_recurrent_gated_delta_rule_packed_decode`` (recurrent state). Here
both are the project's own Triton kernels, same math and launch shape, whose
state loads are gated per row, so that a fresh row reads no state at all:

    query_len[r] = query_start_loc[r + 1] - query_start_loc[r]
    new[r]       = 0 < query_len[r] == seq_lens[r]      # vLLM's device lengths
    conv_in  = new[r] ? 0 : conv_state[slot[r]]         # masked loads: no bytes read
    h        = new[r] ? 0 : ssm_state[slot[r]]
    ...                                                  # the decode step; both states
    conv_state[slot[r]], ssm_state[slot[r]] = ...        # written back as before

No extra launch, no extra byte. The metadata hook still attaches vLLM's
tensors to the step (``compat.DecodeRows``); on fast-path steps the guarded
twin skips its zeroing launch, on every other step it zeroes as shipped.

``install()`` swaps the method and wraps the twin's zeroing in this process.
``benchmarks/engine_cost_worker.py`` calls it at import when the engine's
environment has ``GDN_PASS_BENCH_FUSED=1``: before vLLM captures its CUDA graphs.

Shapes (``B`` rows, one token each; ``H`` key heads and ``HV`` value heads of
``K`` / ``V``; ``D = 2 * H * K + HV * V``; ``W`` the conv width):

    gated_conv1d_update:  x [B, D] (overwritten with the output, as vLLM's),
                          conv_state [slots, D, >= W - 1] (any strides),
                          weight [D, W], bias [D] or None, slots [B] (any stride)
    gated_packed_decode:  mixed_qkv [B, D], a / b [B, HV], A_log / dt_bias [HV],
                          state [slots, HV, V, K], out [B, 1, HV, V], slots [B]

Rows whose slot is ``<= 0`` (``PAD_SLOT_ID`` -1, the null block 0) are
skipped as vLLM's kernels skip them: no state read or written, and the
recurrent output is zero.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["gated_conv1d_update", "gated_packed_decode", "install", "install_if_asked"]

_SOFTPLUS_THRESHOLD = 20.0


@triton.jit
def _row_has_state(starts_ptr, seq_lens_ptr, row):
    """False for a row whose tokens are all new (no token computed before this step)."""
    query_len = tl.load(starts_ptr + row + 1) - tl.load(starts_ptr + row)
    return ((query_len <= 0) | (tl.load(seq_lens_ptr + row) != query_len)).to(tl.int1)


@triton.jit
def _gated_conv1d_update_kernel(
    x_ptr, weight_ptr, bias_ptr, state_ptr, slot_ptr, starts_ptr, seq_lens_ptr, dim,
    stride_x_row, stride_w_dim, stride_w_tap, stride_s_slot, stride_s_dim, stride_s_pos, stride_slot,
    WIDTH: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = channels < dim
    slot = tl.load(slot_ptr + row * stride_slot).to(tl.int64)
    if slot > 0:
        has_state = _row_has_state(starts_ptr, seq_lens_ptr, row)
        # The window, oldest token first: W - 1 state taps, then the new token (padded to a power of 2).
        taps = tl.arange(0, TAPS)
        in_window = inside[:, None] & (taps[None, :] < WIDTH)
        held = inside[:, None] & (taps[None, :] < WIDTH - 1)
        # (the flag as a block, not a broadcast scalar: Triton's CPU interpreter needs a dense mask)
        read = held & ((tl.zeros([BLOCK, TAPS], dtype=tl.int32) + has_state.to(tl.int32)) != 0)
        state_at = state_ptr + slot * stride_s_slot + channels[:, None] * stride_s_dim
        x = tl.load(x_ptr + row * stride_x_row + channels, mask=inside, other=0)
        window = tl.load(state_at + taps[None, :] * stride_s_pos, mask=read, other=0)
        window = tl.where(taps[None, :] == WIDTH - 1, x[:, None], window)
        weights = tl.load(weight_ptr + channels[:, None] * stride_w_dim + taps[None, :] * stride_w_tap,
                          mask=in_window, other=0).to(tl.float32)
        acc = tl.sum(window.to(tl.float32) * weights, 1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + channels, mask=inside, other=0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        # Shift by one token: tap j + 1 of the window goes to state tap j. Another thread of this
        # program may hold tap j: every load of the window must be done before any store.
        tl.debug_barrier()
        tl.store(state_at + (taps[None, :] - 1) * stride_s_pos, window,
                 mask=inside[:, None] & (taps[None, :] >= 1) & (taps[None, :] < WIDTH))
        tl.store(x_ptr + row * stride_x_row + channels, acc.to(x_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _gated_packed_decode_kernel(
    qkv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, out_ptr, state_ptr, slot_ptr, starts_ptr, seq_lens_ptr,
    scale, stride_qkv_row, stride_a_row, stride_b_row, stride_state_slot, stride_slot,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SOFTPLUS_THRESHOLD: tl.constexpr, L2NORM: tl.constexpr,
):
    v_block, row_head = tl.program_id(0), tl.program_id(1)
    row = row_head // HV
    value_head = row_head % HV
    key_head = value_head // (HV // H)
    ks = tl.arange(0, BK)
    vs = v_block * BV + tl.arange(0, BV)
    k_in, v_in = ks < K, vs < V
    out_at = out_ptr + (row * HV + value_head) * V + vs
    slot = tl.load(slot_ptr + row * stride_slot).to(tl.int64)
    if slot <= 0:
        tl.store(out_at, tl.zeros([BV], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=v_in)
    else:
        has_state = _row_has_state(starts_ptr, seq_lens_ptr, row)
        tile = v_in[:, None] & k_in[None, :]
        read = tile & ((tl.zeros([BV, BK], dtype=tl.int32) + has_state.to(tl.int32)) != 0)
        state_at = state_ptr + slot * stride_state_slot + value_head * V * K + vs[:, None] * K + ks[None, :]
        h = tl.load(state_at, mask=read, other=0).to(tl.float32)  # [BV, BK], as vLLM stores it
        token = qkv_ptr + row * stride_qkv_row
        q = tl.load(token + key_head * K + ks, mask=k_in, other=0).to(tl.float32)
        k = tl.load(token + H * K + key_head * K + ks, mask=k_in, other=0).to(tl.float32)
        v = tl.load(token + 2 * H * K + value_head * V + vs, mask=v_in, other=0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        q = q * scale
        x = tl.load(a_ptr + row * stride_a_row + value_head).to(tl.float32) + tl.load(dt_bias_ptr + value_head).to(
            tl.float32)
        softplus = tl.where(x <= SOFTPLUS_THRESHOLD, tl.log(1.0 + tl.exp(x)), x)
        decay = tl.exp(-tl.exp(tl.load(a_log_ptr + value_head).to(tl.float32)) * softplus)
        # beta is rounded to b's dtype first, as vLLM's kernel does
        beta = tl.sigmoid(tl.load(b_ptr + row * stride_b_row + value_head).to(tl.float32))
        beta = beta.to(b_ptr.dtype.element_ty).to(tl.float32)
        h = h * decay
        delta = (v - tl.sum(h * k[None, :], 1)) * beta
        h = h + delta[:, None] * k[None, :]
        tl.store(out_at, tl.sum(h * q[None, :], 1).to(out_ptr.dtype.element_ty), mask=v_in)
        tl.store(state_at, h.to(state_ptr.dtype.element_ty), mask=tile)


def gated_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        activation: str | bool | None, slots: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor) -> torch.Tensor:
    """One-token causal conv update of every row, its window read only if the row has state."""
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    original_dtype = x.dtype
    x = x.to(conv_state.dtype)
    rows, dim = slots.numel(), x.shape[1]
    width = weight.shape[1]
    if x.stride(1) != 1 or conv_state.shape[1] != dim or conv_state.shape[2] < width - 1:
        raise ValueError(f"x {tuple(x.shape)} / conv_state {tuple(conv_state.shape)} / weight "
                         f"{tuple(weight.shape)} do not make a one-token conv update")
    block = 256
    _gated_conv1d_update_kernel[(rows, triton.cdiv(dim, block))](
        x, weight, bias if bias is not None else weight, conv_state, slots, query_start_loc, seq_lens, dim,
        x.stride(0), weight.stride(0), weight.stride(1), *conv_state.stride(), slots.stride(0),
        WIDTH=width, TAPS=triton.next_power_of_2(width), HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"), BLOCK=block)
    return x.to(original_dtype)


def gated_packed_decode(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor, scale: float, state: torch.Tensor, out: torch.Tensor,
                        slots: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        use_qk_l2norm_in_kernel: bool = True) -> None:
    """One gated-delta-rule decode step per row into ``out``, its state read only if the row has state."""
    rows = mixed_qkv.shape[0]
    num_value_heads, value_dim, key_dim = state.shape[-3:]
    query_dim = (mixed_qkv.shape[1] - num_value_heads * value_dim) // 2
    num_key_heads = query_dim // key_dim
    if (query_dim * 2 + num_value_heads * value_dim != mixed_qkv.shape[1] or num_key_heads * key_dim != query_dim
            or num_value_heads % num_key_heads or out.shape != (rows, 1, num_value_heads, value_dim)
            or not out.is_contiguous() or state.stride(-1) != 1 or mixed_qkv.stride(1) != 1):
        raise ValueError(f"mixed_qkv {tuple(mixed_qkv.shape)} / state {tuple(state.shape)} / out "
                         f"{tuple(out.shape)} do not make a packed GDN decode")
    bv = min(triton.next_power_of_2(value_dim), 32)
    _gated_packed_decode_kernel[(triton.cdiv(value_dim, bv), rows * num_value_heads)](
        mixed_qkv, a, b, A_log, dt_bias, out, state, slots, query_start_loc, seq_lens, scale,
        mixed_qkv.stride(0), a.stride(0), b.stride(0), state.stride(0), slots.stride(0),
        H=num_key_heads, HV=num_value_heads, K=key_dim, V=value_dim, BK=triton.next_power_of_2(key_dim), BV=bv,
        SOFTPLUS_THRESHOLD=_SOFTPLUS_THRESHOLD, L2NORM=use_qk_l2norm_in_kernel, num_warps=1, num_stages=3)


# ----------------------------------------------------------------- vLLM 0.26 wiring (benchmarks only)


def _takes_fast_path(layer, metadata) -> bool:
    """The condition of ``QwenGatedDeltaNetAttention._forward_core`` for its packed decode path (0.26)."""
    return bool(getattr(layer, "enable_packed_recurrent_decode", False) and metadata.spec_sequence_masks is None
                and metadata.num_prefills == 0 and metadata.num_decodes > 0)


def install() -> None:
    """Swap vLLM 0.26's decode fast path for the gated kernels; the twin skips its zeroing there."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as qwen

    from gdn_pass.vllm import guarded_ops
    from gdn_pass.vllm.state_guard import DECODE_ROWS_ATTR

    layer_class = qwen.QwenGatedDeltaNetAttention
    if getattr(layer_class, "_gdn_pass_fused", False):
        return
    original = layer_class._forward_core_decode_non_spec

    @functools.wraps(original)
    def decode_non_spec(self, mixed_qkv, b, a, core_attn_out, attn_metadata):
        rows = getattr(attn_metadata, DECODE_ROWS_ATTR, None)
        if rows is None:  # the twin zeroed this step's fresh slots: vLLM's kernels are right
            return original(self, mixed_qkv, b, a, core_attn_out, attn_metadata)
        n = attn_metadata.num_actual_tokens
        slots = attn_metadata.non_spec_state_indices_tensor[:n]
        conv_state = self.kv_cache[0] if qwen.is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        conv_weights = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        mixed_qkv = gated_conv1d_update(mixed_qkv[:n], conv_state, conv_weights, self.conv1d.bias, self.activation,
                                        slots, rows.query_start_loc, rows.seq_lens)
        gated_packed_decode(mixed_qkv, a[:n], b[:n], self.A_log, self.dt_bias, self.head_k_dim ** -0.5,
                            self.kv_cache[1], core_attn_out[:n].unsqueeze(1), slots, rows.query_start_loc,
                            rows.seq_lens, use_qk_l2norm_in_kernel=True)

    zero = guarded_ops.zero_fresh_state

    @functools.wraps(zero)
    def zero_unless_fused(layer_name):
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if isinstance(context.attn_metadata, dict):
            layer = context.no_compile_layers[layer_name]
            metadata = context.attn_metadata.get(getattr(layer, "prefix", layer_name))
            if (metadata is not None and getattr(metadata, DECODE_ROWS_ATTR, None) is not None
                    and _takes_fast_path(layer, metadata)):
                from gdn_pass.vllm.step_guard import note_twin_layer

                note_twin_layer(layer_name)
                return  # the gated kernels read no fresh row's state
        return zero(layer_name)

    layer_class._forward_core_decode_non_spec = decode_non_spec
    layer_class._gdn_pass_fused = True
    guarded_ops.zero_fresh_state = zero_unless_fused


def install_if_asked() -> bool:
    """``install()`` where the environment says ``GDN_PASS_BENCH_FUSED=1``; whether it did."""
    if os.environ.get("GDN_PASS_BENCH_FUSED") != "1":
        return False
    install()
    return True
