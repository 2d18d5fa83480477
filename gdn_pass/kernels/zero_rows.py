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
``zero_new_rows_groups`` is that launch for several groups of caches
(vLLM's KV-cache groups of state layers: 3 in a 48-layer Qwen3-Next), each
with its own slot tensor, sharing the step's rows: one launch per step
whatever the number of groups (up to ``MAX_GROUPS`` per launch).
All launch through ``fast_launch``: after a kernel's first launch, its
compiled kernel's C launcher alone.

The kernels are in ``gdn_pass.kernels._zero_triton``; it and Triton are imported
on the first CUDA launch, so this module imports where Triton does not.
"""

from __future__ import annotations

import weakref

import torch

from gdn_pass.kernels.fast_launch import Launcher

__all__ = ["zero_rows", "zero_rows_all", "zero_new_rows_all", "zero_new_rows_groups", "CacheTable",
           "MAX_GROUPS"]

_BLOCK = 1024
# Programs per row: a row that is not fresh costs these many programs that
# exit at once, so keep it small; a fresh row is zeroed by this many programs
# looping over its slot.
_SLICES = 16


def zero_rows(cache: torch.Tensor, slot: torch.Tensor, fresh: torch.Tensor) -> None:
    """Zero ``cache[slot[b]]`` for every fresh row ``b`` whose slot is not negative.

    Args:
        cache: ``[num_slots, *S]``, any dtype, on CUDA or CPU; modified in place.
        slot: ``[max_rows]`` integer, contiguous, on the cache's device: each row's slot.
        fresh: ``[max_rows]`` bool, contiguous, on the cache's device.

    Guarantees: every element of a fresh row's slot becomes zero; nothing
    else in ``cache`` is written (not the memory past a slot when the slot
    stride exceeds it). CUDA with dense slots (``_dense_slots``): one launch
    whose grid depends only on ``max_rows`` and the cache's shape, no host
    sync, capturable in a CUDA graph. CPU, or CUDA slots that are not dense:
    the fresh slots are selected by boolean indexing and zeroed with
    ``index_fill_`` (a host sync on CUDA); inside CUDA-graph capture the latter
    raises ``RuntimeError`` instead.
    """
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


_kernel = None  # _zero_triton.zero_fresh_rows_kernel, once launched


def _zero_rows_triton(cache: torch.Tensor, slot: torch.Tensor, fresh: torch.Tensor) -> None:
    """``zero_rows`` in one launch, for a CUDA ``cache [num_slots, *S]`` with dense slots.

    ``slot`` / ``fresh``: ``[max_rows]``, contiguous, as ``zero_rows``. Grid
    ``(max_rows, slices)``: up to ``_SLICES`` programs per row share its slot.
    """
    global _kernel
    if _kernel is None:
        _kernel = _kernels().zero_fresh_rows_kernel
    slot_numel = cache[0].numel()
    slices = min(_SLICES, (slot_numel + _BLOCK - 1) // _BLOCK)
    per_slice = (slot_numel + slices - 1) // slices
    _kernel[(slot.numel(), slices)](cache, slot, fresh, cache.stride(0), slot_numel, per_slice, BLOCK=_BLOCK)


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

    Args:
        table: a ``CacheTable`` of CUDA caches (``table.table [num_caches, 3]`` int64).
        slot: ``[max_rows]`` integer, contiguous, on the caches' device: each row's slot.
        fresh: ``[max_rows]`` bool, on the caches' device.

    Guarantees: as ``zero_rows`` for each cache (a fresh row's slot all zero
    in every cache, nothing else written, a negative slot writes nothing); no
    host sync; the grid depends only on the device, so a captured launch serves
    every later step. ``ValueError`` when ``slot`` and ``fresh`` differ in rows.
    """
    global _multi_kernel
    if _multi_kernel is None:
        _multi_kernel = Launcher(_kernels().zero_fresh_rows_all_kernel)
    rows = slot.numel()
    if fresh.numel() != rows:
        raise ValueError(f"fresh has {fresh.numel()} rows, slot {rows}")
    chunks = max(1, -(-table.max_slot_words // _CHUNK_WORDS))
    num_caches, block_rows = table.table.shape[0], max(16, 1 << (rows - 1).bit_length())
    # Launcher key: what Triton specializes on (the tensors' layout, every integer, the
    # constexprs) and the device.
    key = (slot.get_device(), *_layout(table.table, slot, fresh), rows, num_caches, chunks, _CHUNK_WORDS,
           block_rows)
    _multi_kernel((_programs(slot.device), 1, 1), key, table.table, slot, fresh, rows, num_caches, chunks,
                  _CHUNK_WORDS, block_rows, _BLOCK)


_multi_kernel = None  # fast_launch.Launcher of _zero_triton.zero_fresh_rows_all_kernel, once launched
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

    Args:
        table: a ``CacheTable`` of CUDA caches.
        slot: ``[>= num_rows]`` or ``[>= num_rows, columns]`` integer, any
            strides (vLLM's ``non_spec_state_indices_tensor``, or a speculative
            builder's ``[rows, 1 + k]`` slots: every column of a fresh row is
            zeroed, in the same launch).
        query_start_loc: ``[>= num_rows + 1]`` integer, contiguous.
        seq_lens: ``[>= num_rows]`` integer, contiguous.
        num_rows: the step's rows (an int on the host).
        max_rows: at least ``num_rows``; fixes the kernel's row block, so that
            steps of any size share one compiled kernel.

    Tensors on the caches' device. Guarantees: as ``zero_rows_all`` for the
    fresh rows above, in one launch whose host cost is about a torch op's
    (``fast_launch``). Nothing is staged or copied: under FULL CUDA graphs the
    captured launch reads vLLM's persistent buffers, which vLLM refreshes
    before each replay (padding rows run no tokens). ``ValueError`` when
    ``slot`` is not 1-D or 2-D, another tensor is not 1-D, or the rows do not
    fit ``max_rows`` or the tensors.
    """
    global _new_rows_kernel
    if _new_rows_kernel is None:
        _new_rows_kernel = Launcher(_kernels().zero_new_rows_all_kernel)
    if (slot.dim() not in (1, 2) or (query_start_loc.dim(), seq_lens.dim()) != (1, 1) or not 0 <= num_rows <= min(
            max_rows, slot.shape[0], seq_lens.numel(), query_start_loc.numel() - 1)):
        raise ValueError(
            f"{num_rows} rows do not fit max_rows={max_rows} and slot {tuple(slot.shape)} (1-D or 2-D), "
            f"seq_lens {tuple(seq_lens.shape)}, query_start_loc {tuple(query_start_loc.shape)} (1-D each)")
    chunks = max(1, -(-table.max_slot_words // _CHUNK_WORDS))
    columns, column_stride = (1, 0) if slot.dim() == 1 else (slot.shape[1], slot.stride(1))
    num_caches, block_rows = table.table.shape[0], max(16, 1 << (max_rows - 1).bit_length())
    # Launcher key: what Triton specializes on (the tensors' layout, every integer but the
    # strides and counts it is told not to, the constexprs) and the device.
    key = (slot.get_device(), *_layout(table.table, slot, query_start_loc, seq_lens), num_caches, chunks,
           _CHUNK_WORDS, block_rows)
    _new_rows_kernel((_programs(slot.device), 1, 1), key, table.table, slot, slot.stride(0), column_stride, columns,
                     query_start_loc, seq_lens, num_rows, num_caches, chunks, _CHUNK_WORDS, block_rows, _BLOCK)


_new_rows_kernel = None  # fast_launch.Launcher of _zero_triton.zero_new_rows_all_kernel, once launched

# Groups one launch of ``zero_new_rows_groups`` covers (the kernel takes each group's slot
# tensor as four scalars); more groups take more launches.
MAX_GROUPS = 8


def zero_new_rows_groups(tables: list[CacheTable], slots: list[torch.Tensor], query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, num_rows: int, max_rows: int) -> int:
    """``zero_new_rows_all`` for several groups of caches that share the step's rows; the launches made.

    Group ``g``'s caches (``tables[g]``) take a new row's slots from
    ``slots[g]``; the new rows are found once, from ``query_start_loc``,
    ``seq_lens`` and ``num_rows`` as in ``zero_new_rows_all``::

        for g, r in groups x rows:
            if r < num_rows and 0 < query_len[r] == seq_lens[r]:
                for cache in tables[g]: cache[slots[g][r, every column]] = 0

    Args:
        tables: one ``CacheTable`` per group (CUDA caches).
        slots: one slot tensor per group, ``[>= num_rows]`` or ``[>= num_rows, columns]``, any
            strides, all of one integer dtype (int32 or int64); columns may differ by group.
        query_start_loc, seq_lens, num_rows, max_rows: as ``zero_new_rows_all``.

    Guarantees: as ``zero_new_rows_all`` on each group, in ``ceil(groups / MAX_GROUPS)``
    launches. The groups' merged table is made on the device the first time a set of
    tables is seen (outside CUDA-graph capture: the caller's promise) and kept while
    those tables live. ``ValueError`` for an empty or mismatched list, slots of
    different dtypes, or rows that do not fit as in ``zero_new_rows_all``.
    """
    global _groups_kernel
    if not tables or len(tables) != len(slots):
        raise ValueError(f"{len(tables)} cache tables for {len(slots)} slot tensors")
    dtype = slots[0].dtype
    if dtype not in (torch.int32, torch.int64) or any(s.dtype != dtype for s in slots):
        raise ValueError(f"the groups' slots must share one dtype, int32 or int64: {[s.dtype for s in slots]}")
    if (any(s.dim() not in (1, 2) or s.shape[0] < num_rows for s in slots)
            or (query_start_loc.dim(), seq_lens.dim()) != (1, 1)
            or not 0 <= num_rows <= min(max_rows, seq_lens.numel(), query_start_loc.numel() - 1)):
        raise ValueError(
            f"{num_rows} rows do not fit max_rows={max_rows} and slots {[tuple(s.shape) for s in slots]} "
            f"(1-D or 2-D), seq_lens {tuple(seq_lens.shape)}, query_start_loc {tuple(query_start_loc.shape)}")
    if _groups_kernel is None:
        _groups_kernel = Launcher(_kernels().zero_new_rows_groups_kernel)
    block_rows = max(16, 1 << (max_rows - 1).bit_length())
    launches = 0
    for first in range(0, len(tables), MAX_GROUPS):
        part = tables[first : first + MAX_GROUPS]
        merged, num_caches, max_slot_words = _merged_table(part)
        args = []
        for s in slots[first : first + MAX_GROUPS]:
            columns, column_stride = (1, 0) if s.dim() == 1 else (s.shape[1], s.stride(1))
            args += (s.data_ptr(), s.stride(0), column_stride, columns)
        max_columns = max(args[3::4])
        args += args[:4] * (MAX_GROUPS - len(part))  # unused groups: no cache names them
        chunks = max(1, -(-max_slot_words // _CHUNK_WORDS))
        # Launcher key: the tensors' layout, the integers Triton specializes (the counts, constexprs),
        # and whether each slot address needs 64 bits (Triton types an integer by its range).
        key = (query_start_loc.get_device(), *_layout(merged, query_start_loc, seq_lens), num_caches, chunks,
               _CHUNK_WORDS, block_rows, dtype, tuple(a > 0x7FFFFFFF for a in args[::4]))
        _groups_kernel((_programs(query_start_loc.device), 1, 1), key, merged, query_start_loc, seq_lens, num_rows,
                       num_caches, max_columns, chunks, _CHUNK_WORDS, *args, block_rows, _BLOCK,
                       dtype == torch.int64)
        launches += 1
    return launches


_groups_kernel = None  # fast_launch.Launcher of _zero_triton.zero_new_rows_groups_kernel, once launched
# The merged tables of the last sets of groups seen: {ids of the tables: (weak references to the
# tables, merged, caches, max slot words)}. Weak: a table holds its engine's caches, which must go
# when the engine goes; a dead reference (its id perhaps reused since) makes the entry stale. Few
# sets are ever live (one per engine), so the oldest is dropped past a handful.
_merged: dict[tuple, tuple] = {}


def _merged_table(tables: list[CacheTable]) -> tuple[torch.Tensor, int, int]:
    """``[caches, 4]`` int64 on the caches' device: each table's rows with its group's index appended."""
    key = tuple(id(t) for t in tables)
    found = _merged.get(key)
    if found is None or any(ref() is not t for ref, t in zip(found[0], tables)):
        parts = [torch.cat([t.table, torch.full_like(t.table[:, :1], g)], dim=1) for g, t in enumerate(tables)]
        merged = torch.cat(parts).contiguous()
        found = ([weakref.ref(t) for t in tables], merged, merged.shape[0], max(t.max_slot_words for t in tables))
        _merged.pop(key, None)
        if len(_merged) >= 8:
            _merged.pop(next(iter(_merged)))
        _merged[key] = found
    return found[1], found[2], found[3]


def _layout(*tensors: torch.Tensor) -> tuple:
    """What Triton specializes a tensor argument on: its dtype and whether its address is 16-byte aligned."""
    return tuple(x for t in tensors for x in (t.dtype, t.data_ptr() % 16 == 0))


def _kernels():
    """The kernel module, imported on the first launch: it imports Triton, which CPU engines may lack."""
    from gdn_pass.kernels import _zero_triton

    return _zero_triton
