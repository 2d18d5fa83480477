"""Refresh every staged per-row buffer in one launch (CUDA): ``StagedRowMetadata.stage``'s fast path.

The plain PyTorch staging is about twenty small element-wise launches per
call; on CUDA each costs host time (measured in a real vLLM 0.26 engine on an
H200: ~0.3 ms per builder, ~1 ms per step of a 12-layer model). Here the
host folds what it knows into one byte per row, copies it once, and a single
program writes all five buffers:

    flags[b] = (query_len[b] > 0) | (computed[b] > 0) << 1     # host, [n] uint8
    for b in range(max_rows):                                   # one Triton program per BLOCK rows
        real      = b < n
        slot      = slots[b]                                     # device, read in place
        valid     = real & flags[b].bit0 & slot not in (pad0, pad1)
        has_init  = real & flags[b].bit1
        fresh     = valid & ~has_init & ~(zero_start <= b < zero_stop)
        reads     = valid & has_init
        state_slot[b] = slot if valid else pad0

Shapes: ``flags [n]`` uint8 and ``slots [n]`` integer (any stride), both on
the device; outputs ``[max_rows]`` (bool, bool, bool, bool, int64), rows
``n .. max_rows-1`` padding. No host sync: the flags
copy does not wait for the stream (measured: ``StagedRowMetadata._fused_stage``)
and nothing is read back.

The kernel is ``gdn_pass.kernels._stage_triton.stage_rows_kernel``; it and Triton are
imported on the first launch, so this module imports where Triton does not.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["stage_rows_fused", "row_flags"]

_BLOCK = 1024
_kernel = None  # _stage_triton.stage_rows_kernel, once launched


def row_flags(query_lens: torch.Tensor, num_computed_tokens: torch.Tensor) -> torch.Tensor:
    """``[n]`` uint8 on the host: bit 0 ``query_len > 0``, bit 1 ``computed > 0`` (host tensors in).

    numpy on views of the host tensors: about a microsecond per op, where a
    torch op on a few dozen CPU elements costs several.
    """
    flags = (query_lens.numpy() > 0).astype(np.uint8)
    flags |= (num_computed_tokens.numpy() > 0).astype(np.uint8) << 1
    return torch.from_numpy(flags)


def stage_rows_fused(
    *,
    flags: torch.Tensor,
    slots: torch.Tensor,
    zero_start_rows: tuple[int, int],
    pad_slot_ids: tuple[int, int],
    has_initial_state: torch.Tensor,
    valid: torch.Tensor,
    reads_state: torch.Tensor,
    fresh: torch.Tensor,
    state_slot: torch.Tensor,
) -> None:
    """Write the five ``[max_rows]`` buffers from ``flags`` and the slots, in one launch.

    Args (all tensors on one CUDA device; the outputs are written in place):
        flags: ``[n]`` uint8, contiguous, from ``row_flags``: bit 0 the row runs tokens,
            bit 1 it has computed tokens.
        slots: ``[n]`` integer (int32 or int64), any stride: each row's state slot.
        zero_start_rows: ``(start, stop)``, ``0 <= start <= stop <= n``: rows whose
            kernels start from zero state by themselves (vLLM's prefill path),
            never fresh; ``(0, 0)``: none.
        pad_slot_ids: ``(pad0, pad1)``: the padding sentinels (pass one twice
            if there is only one); a padding row's ``state_slot`` is ``pad0``.
        has_initial_state, valid, reads_state, fresh: ``[max_rows]`` bool, contiguous, out.
        state_slot: ``[max_rows]`` int64, contiguous, out.

    Guarantees: rows ``n .. max_rows - 1`` come out as padding (all False, slot
    ``pad0``), as the module docstring defines each buffer; no host sync, and
    nothing but the five outputs is written. Triton is imported on the first call.
    """
    global _kernel
    if _kernel is None:
        from gdn_pass.kernels import _stage_triton  # imports Triton

        _kernel = _stage_triton.stage_rows_kernel
    n = flags.numel()
    max_rows = state_slot.numel()
    grid = ((max_rows + _BLOCK - 1) // _BLOCK,)
    _kernel[grid](
        flags, slots, slots.stride(0) if n else 1, n, max_rows,
        zero_start_rows[0], zero_start_rows[1], pad_slot_ids[0], pad_slot_ids[1],
        has_initial_state, valid, reads_state, fresh, state_slot, BLOCK=_BLOCK,
    )
