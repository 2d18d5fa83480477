"""Zero the state slots of fresh rows, without a host sync, capturable in a CUDA graph.

    for b in range(max_rows):            # Triton programs per (row, slice of the slot)
        if fresh[b]:
            cache[slot[b]] = 0

Shapes: ``cache [num_slots, *S]`` (a slot's elements dense in memory, any
order; the slot stride may exceed them, as in vLLM's shared page pool),
``slot [max_rows]`` integer, ``fresh [max_rows]`` bool. Rows that are not
fresh write nothing, so padding rows and sentinel slot ids are never
dereferenced. The grid depends only on ``max_rows``, so one captured graph
serves every step while the staged buffers are refreshed in place.

On CPU (or for a layout the kernel does not cover, outside capture) the
fresh slots are selected on the host and zeroed with ``index_fill_``.
"""

from __future__ import annotations

import torch

__all__ = ["zero_rows"]

_BLOCK = 1024
# Programs per row: a row that is not fresh costs these many programs that
# exit at once, so keep it small; a fresh row is zeroed by this many programs
# looping over its slot.
_SLICES = 16


def zero_rows(cache: torch.Tensor, slot: torch.Tensor, fresh: torch.Tensor) -> None:
    if cache.is_cuda and _dense_slots(cache):
        _zero_rows_triton(cache, slot, fresh)
        return
    if cache.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"gdn-pass cannot zero fresh slots of a {tuple(cache.shape)} state with strides "
            f"{cache.stride()} inside CUDA-graph capture: a slot's elements are not dense"
        )
    slots = slot[fresh]
    if slots.numel():
        cache.index_fill_(0, slots.to(cache.device), 0)


def _dense_slots(cache: torch.Tensor) -> bool:
    """Do a slot's elements fill exactly ``numel`` consecutive elements (in any order)?"""
    if cache.dim() < 1 or cache.shape[0] == 0:
        return False
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(cache.stride()[1:], cache.shape[1:]) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


_kernel = None


def _zero_rows_triton(cache: torch.Tensor, slot: torch.Tensor, fresh: torch.Tensor) -> None:
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    slot_numel = cache[0].numel()
    slices = min(_SLICES, (slot_numel + _BLOCK - 1) // _BLOCK)
    per_slice = (slot_numel + slices - 1) // slices
    _kernel[(slot.numel(), slices)](cache, slot, fresh, cache.stride(0), slot_numel, per_slice, BLOCK=_BLOCK)


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def zero_fresh_rows(cache_ptr, slot_ptr, fresh_ptr, slot_stride, slot_numel, per_slice,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0)
        part = tl.program_id(1)
        if tl.load(fresh_ptr + row).to(tl.int1):
            slot = tl.load(slot_ptr + row).to(tl.int64)
            start = part * per_slice
            end = tl.minimum(start + per_slice, slot_numel)
            zeros = tl.zeros([BLOCK], dtype=cache_ptr.dtype.element_ty)
            for offset in range(start, end, BLOCK):
                offs = offset + tl.arange(0, BLOCK)
                tl.store(cache_ptr + slot * slot_stride + offs, zeros, mask=offs < end)

    return zero_fresh_rows
