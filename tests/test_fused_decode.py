"""The fused alternative's gated decode kernels (``benchmarks/fused_decode.py``) against a naive reference, on CPU.

The kernels run in Triton's interpreter, in a subprocess started with
``TRITON_INTERPRET=1`` (as ``tests/vllm/test_zero_rows.py``). The reference
is a per-row PyTorch loop over the gated delta rule written from its
definition (not from the kernels):

    conv:  y = silu(bias + sum_j w[:, j] * window[:, j]),  window = [state (W - 1 taps), x]
    decay  g    = exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
           q, k = l2norm(q) * scale, l2norm(k)
           h    = g * h0;  h += outer(beta * (v - h k), k);  o = h q

with ``h0`` and the conv window's old taps zero for a new row (no token
computed before: ``seq_len == query_len``). The state slots of new rows hold
poison (1e4): a kernel that read them would be far off. Rows naming slot -1
or the null block 0 touch no state. ``tests/gpu/test_fused_decode.py``
compares the kernels with vLLM's own on CUDA.
"""

import json

import pytest
import torch

from tests.triton_interpreter import run_in_interpreter

pytest.importorskip("triton")

H, HV, K, V, WIDTH, SLOTS = 2, 4, 16, 8, 4, 12
POISON = 1e4


def reference(x, conv_state, weight, bias, a, b, A_log, dt_bias, state, slots, new):
    """Outputs and updated states, row by row, in float64."""
    x, conv_state, state = x.double(), conv_state.clone().double(), state.clone().double()
    weight, bias, a, b, A_log, dt_bias = (t.double() for t in (weight, bias, a, b, A_log, dt_bias))
    out = torch.zeros(x.shape[0], HV, V, dtype=torch.float64)
    for r, slot in enumerate(slots):
        if slot <= 0:
            continue
        old = torch.zeros(x.shape[1], WIDTH - 1, dtype=torch.float64) if new[r] else conv_state[slot, :, : WIDTH - 1]
        window = torch.cat([old, x[r, :, None]], 1)
        y = torch.nn.functional.silu(bias + (weight * window).sum(1))
        conv_state[slot, :, : WIDTH - 1] = window[:, 1:]
        q, k, v = y[: H * K].view(H, K), y[H * K: 2 * H * K].view(H, K), y[2 * H * K:].view(HV, V)
        for hv in range(HV):
            hk = hv // (HV // H)
            qn = q[hk] / torch.sqrt((q[hk] ** 2).sum() + 1e-6) * K ** -0.5
            kn = k[hk] / torch.sqrt((k[hk] ** 2).sum() + 1e-6)
            g = torch.exp(-torch.exp(A_log[hv]) * torch.nn.functional.softplus(a[r, hv] + dt_bias[hv]))
            beta = torch.sigmoid(b[r, hv])
            h = torch.zeros(V, K, dtype=torch.float64) if new[r] else state[slot, hv]
            h = g * h
            h = h + torch.outer(beta * (v[hv] - h @ kn), kn)
            state[slot, hv] = h
            out[r, hv] = h @ qn
    return out, conv_state, state


def check(seed: int, rows: int) -> list[str]:
    """One random step of ``rows`` rows; what went wrong. Run with the interpreter on."""
    from benchmarks.fused_decode import gated_conv1d_update, gated_packed_decode

    gen = torch.Generator().manual_seed(seed)
    dim = 2 * H * K + HV * V

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    slots = torch.randperm(SLOTS - 1, generator=gen)[:rows] + 1
    slots[0] = -1 if rows > 2 else slots[0]
    if rows > 3:
        slots[1] = 0  # the null block
    new = torch.rand(rows, generator=gen) < 0.5
    query_lens = torch.ones(rows, dtype=torch.int32)
    seq_lens = torch.where(new, query_lens, torch.randint(2, 90, (rows,), generator=gen, dtype=torch.int32))
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    x = rand(rows, dim)
    conv_state = rand(SLOTS, dim, WIDTH - 1 + 1)  # one spare tap: the kernel must keep to W - 1
    state = rand(SLOTS, HV, V, K, scale=0.5)
    for r in range(rows):  # the previous owners' state in new rows' slots
        if new[r] and slots[r] > 0:
            conv_state[slots[r], :, : WIDTH - 1] = POISON
            state[slots[r]] = POISON
    weight, bias = rand(dim, WIDTH, scale=0.5), rand(dim, scale=0.1)
    a, b, A_log, dt_bias = rand(rows, HV), rand(rows, HV), rand(HV, scale=0.5), rand(HV, scale=0.5)
    want_out, want_conv, want_state = reference(x, conv_state, weight, bias, a, b, A_log, dt_bias, state,
                                                slots.tolist(), new.tolist())
    # the conv state as vLLM's SD layout hands it over: a transposed view
    conv_view = conv_state.transpose(1, 2).contiguous().transpose(1, 2)
    got_state = state.clone()
    out = torch.zeros(rows, 1, HV, V)
    block_table = torch.stack([slots, torch.full_like(slots, 5)], 1).to(torch.int32)
    mixed = gated_conv1d_update(x.clone(), conv_view, weight, bias, "silu", block_table[:, 0], starts, seq_lens)
    gated_packed_decode(mixed, a, b, A_log, dt_bias, K ** -0.5, got_state, out, block_table[:, 0], starts, seq_lens)
    errors = []
    real = slots > 0
    if not torch.allclose(out[:, 0][real].double(), want_out[real], atol=1e-3, rtol=1e-3):
        errors.append(f"outputs differ by {(out[:, 0][real].double() - want_out[real]).abs().max():.3g}")
    if not torch.equal(out[:, 0][~real], torch.zeros_like(out[:, 0][~real])):
        errors.append("a padding row's output is not zero")
    if not torch.allclose(conv_view.double(), want_conv, atol=1e-4):
        errors.append(f"conv states differ by {(conv_view.double() - want_conv).abs().max():.3g}")
    if not torch.allclose(got_state.double(), want_state, atol=1e-3, rtol=1e-3):
        errors.append(f"recurrent states differ by {(got_state.double() - want_state).abs().max():.3g}")
    return errors


CASES = [(0, 1), (1, 3), (2, 6), (3, 9)]


@pytest.fixture(scope="module")
def interpreted_results():
    return run_in_interpreter(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-rows{c[1]}")
def test_new_rows_read_no_state_and_the_rest_decode_as_the_reference(interpreted_results, case):
    assert interpreted_results[json.dumps(case)] == []


if __name__ == "__main__":  # the subprocess: every case, its errors as one JSON line
    print(json.dumps({json.dumps(case): check(*case) for case in CASES}))
