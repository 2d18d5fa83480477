"""A torch-native, Qwen3-Next-shaped GatedDeltaNet layer over slot-indexed state caches.

The model knows nothing of freshness or padding: it gathers each row's conv
and recurrent state by slot, runs the short causal conv and the gated delta
rule in plain torch, and writes both states back at the same slots.

Shapes (B rows, L tokens per row this step; L == 1 is decode, L > 1 a
chunk of a chunked prefill):
    hidden       [B, L, hidden]
    conv_cache   [num_slots, conv_dim, kernel - 1]   conv_dim = 2*HK*K + HV*V
    ssm_cache    [num_slots, HV, K, V]
    slots        [B] integer
    returns      [B, L, hidden]

Recurrence per value head h (key head h // (HV // HK)), per token t:
    S <- S * exp(g_t)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (q_t / sqrt(K))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GDNShape:
    hidden: int = 256
    num_k_heads: int = 2  # HK
    num_v_heads: int = 4  # HV
    head_k_dim: int = 32  # K
    head_v_dim: int = 32  # V
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


QWEN3_NEXT_SHAPE = GDNShape(hidden=2048, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)


class TorchGDNLayer(nn.Module):
    """``recurrence="torch"``: the gated delta rule in plain torch (CPU and GPU).
    ``recurrence="fla"``: flash-linear-attention's Triton kernels (GPU), fed a
    gathered ``initial_state`` and written back from ``final_state``:
    ``fused_recurrent_gated_delta_rule`` for decode, ``chunk_gated_delta_rule``
    for chunks.
    """

    def __init__(self, shape: GDNShape, *, seed: int = 0, dtype=torch.float32, recurrence: str = "torch"):
        super().__init__()
        if recurrence not in ("torch", "fla"):
            raise ValueError(f"recurrence must be 'torch' or 'fla', got {recurrence!r}")
        self.recurrence = recurrence
        self.shape = s = shape
        gen = torch.Generator().manual_seed(seed)

        def param(*size, scale):
            return nn.Parameter(((torch.rand(size, generator=gen) * 2 - 1) * scale).to(dtype))

        self.in_proj_qkv = param(s.conv_dim, s.hidden, scale=s.hidden**-0.5)
        self.in_proj_ba = param(2 * s.num_v_heads, s.hidden, scale=s.hidden**-0.5)
        self.conv_weight = param(s.conv_dim, s.conv_kernel, scale=0.5)
        self.A_log = param(s.num_v_heads, scale=1.0)
        self.dt_bias = param(s.num_v_heads, scale=1.0)
        self.out_proj = param(s.hidden, s.num_v_heads * s.head_v_dim, scale=(s.num_v_heads * s.head_v_dim) ** -0.5)

    def new_caches(self, num_slots: int, *, state_dtype=torch.float32, device=None):
        s = self.shape
        conv = torch.zeros(num_slots, s.conv_dim, s.conv_kernel - 1, dtype=self.in_proj_qkv.dtype, device=device)
        ssm = torch.zeros(num_slots, s.num_v_heads, s.head_k_dim, s.head_v_dim, dtype=state_dtype, device=device)
        return conv, ssm

    def forward(self, hidden, conv_cache, ssm_cache, slots):
        s = self.shape
        B, L, _ = hidden.shape
        qkv = hidden @ self.in_proj_qkv.t()  # [B, L, C]
        b, a = (hidden @ self.in_proj_ba.t()).float().chunk(2, dim=-1)  # [B, L, HV]
        beta = torch.sigmoid(b)
        g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())

        conv_state = conv_cache[slots]  # [B, C, W-1]  <- state read
        window = torch.cat([conv_state, qkv.transpose(1, 2)], dim=-1)  # [B, C, W-1+L]
        conv_cache[slots] = window[:, :, L:]  # write-back
        # Explicit loops, not comprehensions: depyf's decompiler (dump command)
        # cannot rebuild the comprehension's bytecode on Python 3.11.
        conv_out = []
        for t in range(L):
            conv_out.append((window[:, :, t : t + s.conv_kernel] * self.conv_weight).sum(-1))
        x = F.silu(torch.stack(conv_out, dim=1).float())  # [B, L, C]
        q, k, v = x.split([s.num_k_heads * s.head_k_dim] * 2 + [s.num_v_heads * s.head_v_dim], dim=-1)
        rep = s.num_v_heads // s.num_k_heads
        q = F.normalize(q.view(B, L, s.num_k_heads, s.head_k_dim), dim=-1).repeat_interleave(rep, dim=2)
        k = F.normalize(k.view(B, L, s.num_k_heads, s.head_k_dim), dim=-1).repeat_interleave(rep, dim=2)
        v = v.view(B, L, s.num_v_heads, s.head_v_dim)

        if self.recurrence == "fla":
            o = self._fla_recurrence(q, k, v, g, beta, ssm_cache, slots)
            return o.reshape(B, L, -1).to(hidden.dtype) @ self.out_proj.t()

        state = ssm_cache[slots].float()  # [B, HV, K, V]  <- state read
        outs = []
        for t in range(L):
            state = state * torch.exp(g[:, t])[..., None, None]
            kv_mem = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
            delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * s.head_k_dim**-0.5))
        ssm_cache[slots] = state.to(ssm_cache.dtype)  # write-back
        o = torch.stack(outs, dim=1).reshape(B, L, -1).to(hidden.dtype)
        return o @ self.out_proj.t()

    def _fla_recurrence(self, q, k, v, g, beta, ssm_cache, slots):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        kernel = fused_recurrent_gated_delta_rule if q.shape[1] == 1 else chunk_gated_delta_rule
        initial_state = ssm_cache[slots].float()  # [B, HV, K, V]  <- state read
        o, final_state = kernel(
            q.contiguous(), k.contiguous(), v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
            scale=self.shape.head_k_dim**-0.5, initial_state=initial_state, output_final_state=True,
        )
        ssm_cache[slots] = final_state.to(ssm_cache.dtype)  # write-back
        return o
