"""The Triton kernel of ``stage.stage_rows_fused``.

Imports Triton: ``stage`` imports this module on its first launch
(CUDA), never when ``gdn_pass`` is imported. ``triton.jit`` reads
``TRITON_INTERPRET`` when it decorates, so a process that wants the CPU
interpreter sets it before this module is imported (or reloads it).
"""

import triton
import triton.language as tl


@triton.jit
def stage_rows_kernel(flags_ptr, slots_ptr, slot_stride, n, max_rows,
                      zero_start, zero_stop, pad0, pad1,
                      has_init_ptr, valid_ptr, reads_ptr, fresh_ptr, slot_out_ptr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(max_rows, BLOCK),)``: each program stages ``BLOCK`` rows of every output."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_buffer = rows < max_rows
    real = rows < n
    flags = tl.load(flags_ptr + rows, mask=real, other=0).to(tl.int32)
    slot = tl.load(slots_ptr + rows.to(tl.int64) * slot_stride, mask=real, other=pad0).to(tl.int64)
    is_pad_slot = (slot == pad0) | (slot == pad1)
    valid = real & ((flags & 1) != 0) & (is_pad_slot == 0)
    has_init = real & ((flags & 2) != 0)
    starts_from_zero = (rows >= zero_start) & (rows < zero_stop)
    fresh = valid & (has_init == 0) & (starts_from_zero == 0)
    tl.store(has_init_ptr + rows, has_init, mask=in_buffer)
    tl.store(valid_ptr + rows, valid, mask=in_buffer)
    tl.store(reads_ptr + rows, valid & has_init, mask=in_buffer)
    tl.store(fresh_ptr + rows, fresh, mask=in_buffer)
    tl.store(slot_out_ptr + rows, tl.where(valid, slot, slot * 0 + pad0), mask=in_buffer)
