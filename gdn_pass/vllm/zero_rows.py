"""Zero the state slots of fresh rows, without a host sync, capturable in a CUDA graph.

    for b in range(max_rows):            # Triton programs per (row, slice of the slot)
        if fresh[b] and slot[b] >= 0:
            cache[slot[b]] = 0

Shapes: ``cache [num_slots, *S]`` (a slot's elements dense in memory, any
order; the slot stride may exceed them, as in vLLM's shared page pool),
``slot [max_rows]`` integer, ``fresh [max_rows]`` bool. Rows that are not
fresh, and rows whose slot is negative (vLLM's ``PAD_SLOT_ID``), write
nothing. The grid depends only on ``max_rows``, so one captured graph
serves every step while the staged buffers are refreshed in place.

On CPU (or for a layout the kernel does not cover, outside capture) the
fresh slots are selected on the host and zeroed with ``index_fill_``.

``CacheTable`` + ``zero_rows_all`` do the same for many caches (every GDN
layer's conv and recurrent state) in one launch: a device table holds each
cache's address, slot stride and slot size. Its grid is a fixed number of
programs (two per SM) that share the step's work, whatever it is::

    k-th fresh row = the row where cumsum(fresh) first reaches k + 1   # every program, in registers
    for item in range(program, count(fresh) * caches * chunks, programs):
        k, cache, chunk = unravel(item)
        cache[slot[k-th fresh row]][chunk] = 0      # a 64 KiB chunk of one slot

so a step with one fresh row spreads its slots (2 MiB per recurrent slot at
Qwen3-Next's dimensions) over the whole GPU, and a step with none costs one
wave of programs that read ``fresh`` and exit.

``zero_new_rows_all`` is the same launch with ``fresh`` derived in the kernel
from vLLM's own per-row lengths (a row whose tokens are all new), for steps
whose rows read vLLM's ``non_spec_state_indices_tensor``: nothing to stage.
"""

from __future__ import annotations

import torch

__all__ = ["zero_rows", "zero_rows_all", "zero_new_rows_all", "CacheTable"]

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
    slots = slots[slots >= 0]  # a padding sentinel is never a slot to write
    if slots.numel():
        cache.index_fill_(0, slots.to(device=cache.device, dtype=torch.int64), 0)


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
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if tl.load(fresh_ptr + row).to(tl.int1) & (slot >= 0):  # -1: a padding sentinel
            start = part * per_slice
            end = tl.minimum(start + per_slice, slot_numel)
            zeros = tl.zeros([BLOCK], dtype=cache_ptr.dtype.element_ty)
            for offset in range(start, end, BLOCK):
                offs = offset + tl.arange(0, BLOCK)
                tl.store(cache_ptr + slot * slot_stride + offs, zeros, mask=offs < end)

    return zero_fresh_rows


class CacheTable:
    """Addresses of several caches, for ``zero_rows_all`` (build outside CUDA-graph capture).

    ``table [num_caches, 3]`` int64 on the caches' device: each cache's
    address (bytes), slot stride and slot size (4-byte words). ``None`` from
    ``build`` when a cache is not on CUDA, has sparse slots, or is not
    4-byte aligned: callers then zero cache by cache.
    """

    def __init__(self, caches: list[torch.Tensor], table: torch.Tensor, max_slot_words: int):
        self.caches = caches
        self.table = table
        self.max_slot_words = max_slot_words
        self.addresses = frozenset(c.data_ptr() for c in caches)

    @classmethod
    def build(cls, caches: list[torch.Tensor]) -> "CacheTable | None":
        if not caches or not all(c.is_cuda and c.shape[0] > 0 and _dense_slots(c) for c in caches):
            return None
        entries = []
        for c in caches:
            size = c.element_size()
            slot_bytes, stride_bytes = c[0].numel() * size, c.stride(0) * size
            if c.data_ptr() % 4 or slot_bytes % 4 or stride_bytes % 4:
                return None
            entries.append((c.data_ptr(), stride_bytes // 4, slot_bytes // 4))
        table = torch.tensor(entries, dtype=torch.int64, device=caches[0].device)
        return cls(list(caches), table, max(e[2] for e in entries))


def zero_rows_all(table: CacheTable, slot: torch.Tensor, fresh: torch.Tensor) -> None:
    """``zero_rows`` on every cache of ``table``, in one launch.

    ``slot`` / ``fresh``: ``[max_rows]``, as staged. The grid depends only on
    the device, so a captured launch serves every later step.
    """
    global _multi_kernel
    if _multi_kernel is None:
        _multi_kernel = _build_multi_kernel()
    rows = slot.numel()
    if fresh.numel() != rows:
        raise ValueError(f"fresh has {fresh.numel()} rows, slot {rows}")
    chunks = max(1, -(-table.max_slot_words // _CHUNK_WORDS))
    _multi_kernel[(_programs(slot.device),)](
        table.table, slot, fresh, rows, table.table.shape[0], chunks, _CHUNK_WORDS,
        ROWS=max(16, 1 << (rows - 1).bit_length()), BLOCK=_BLOCK)


_multi_kernel = None
# A work item zeroes this many 4-byte words of one slot: 64 KiB, so a 2 MiB
# recurrent slot is 32 items spread over the GPU, and a small conv slot one.
_CHUNK_WORDS = 16384
_PROGRAMS_PER_SM = 2
_programs_of: dict[int, int] = {}


def _programs(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _programs_of:
        _programs_of[index] = _PROGRAMS_PER_SM * torch.cuda.get_device_properties(index).multi_processor_count
    return _programs_of[index]


def zero_new_rows_all(table: CacheTable, slot: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, num_rows: int, max_rows: int) -> None:
    """``zero_rows_all`` with the fresh rows found on the device, from vLLM's own step metadata.

    Row ``r < num_rows`` is fresh when it runs tokens and all of them are new::

        query_len[r] = query_start_loc[r + 1] - query_start_loc[r]
        fresh[r]     = r < num_rows and 0 < query_len[r] == seq_lens[r]

    ``slot``: ``[>= num_rows]`` integer, any stride (vLLM's ``non_spec_state_indices_tensor``),
    ``query_start_loc``: ``[>= num_rows + 1]``, ``seq_lens``: ``[>= num_rows]``,
    integers on the caches' device. Nothing is staged or copied: under FULL CUDA
    graphs the captured launch reads vLLM's persistent buffers, which vLLM refreshes
    before each replay (padding rows run no tokens). ``max_rows`` (at least
    ``num_rows``) fixes the kernel's row block, so that steps of any size share
    one compiled kernel.
    """
    global _new_rows_kernel
    if _new_rows_kernel is None:
        _new_rows_kernel = _build_multi_kernel(from_lengths=True)
    if (slot.dim(), query_start_loc.dim(), seq_lens.dim()) != (1, 1, 1) or not 0 <= num_rows <= min(
            max_rows, slot.numel(), seq_lens.numel(), query_start_loc.numel() - 1):
        raise ValueError(
            f"{num_rows} rows do not fit max_rows={max_rows} and slot {tuple(slot.shape)}, "
            f"seq_lens {tuple(seq_lens.shape)}, query_start_loc {tuple(query_start_loc.shape)} (1-D each)")
    chunks = max(1, -(-table.max_slot_words // _CHUNK_WORDS))
    _new_rows_kernel[(_programs(slot.device),)](
        table.table, slot, slot.stride(0), query_start_loc, seq_lens, num_rows, table.table.shape[0], chunks, _CHUNK_WORDS,
        ROWS=max(16, 1 << (max_rows - 1).bit_length()), BLOCK=_BLOCK)


_new_rows_kernel = None


def _build_multi_kernel(from_lengths: bool = False):
    # Triton is imported only when a CUDA step first zeroes (CPU engines may lack it).
    from gdn_pass.vllm import _zero_kernels

    return _zero_kernels.zero_new_rows_all if from_lengths else _zero_kernels.zero_fresh_rows_all
