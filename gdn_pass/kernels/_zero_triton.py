"""The Triton kernels of ``zero_rows.zero_rows``, ``zero_rows_all`` and ``zero_new_rows_all``.

Imports Triton: ``zero_rows`` imports this module on its first CUDA launch,
never when ``gdn_pass`` or its vLLM adapter is imported (CPU engines may lack Triton).
``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, so a process
that wants the CPU interpreter sets it before this module is imported.
"""

import triton
import triton.language as tl


@triton.jit
def zero_fresh_rows_kernel(cache_ptr, slot_ptr, fresh_ptr, slot_stride, slot_numel, per_slice,
                           BLOCK: tl.constexpr):
    """Grid ``(max_rows, slices)``: program ``(row, part)`` zeroes that part of a fresh row's slot."""
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


@triton.jit
def zero_chunks(table_ptr, slot_ptr, slot_stride, column_stride, columns, rows, flags, num_caches, chunks,
                chunk_words, BLOCK: tl.constexpr):
    """This program's share of every (fresh row, slot column, cache, chunk) work item; ``flags``:
    ``[ROWS]`` int32 0/1; a row's slot in column ``c`` at ``slot_ptr + row * slot_stride + c * column_stride``."""
    # rank[r] = how many fresh rows come up to and including r; the k-th fresh row is the
    # fresh row of rank k + 1.
    rank = tl.cumsum(flags, 0)
    items_per_column = num_caches * chunks
    items_per_row = columns * items_per_column
    total = tl.sum(flags, 0) * items_per_row
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        k, column, cache, chunk = unravel(item, items_per_row, items_per_column, chunks)
        row = kth_fresh_row(rank, flags, rows, k)
        slot = tl.load(slot_ptr + row * slot_stride + column * column_stride).to(tl.int64)
        numel = tl.load(table_ptr + cache * 3 + 2)
        start = chunk.to(tl.int64) * chunk_words
        if (slot >= 0) & (start < numel):  # -1: a padding sentinel; small caches have fewer chunks
            zero_chunk(table_ptr + cache * 3, slot, start, numel, chunk_words, BLOCK)


@triton.jit
def kth_fresh_row(rank, flags, rows, k):
    """The row of the ``k``-th fresh row (from 0): the fresh row whose rank is ``k + 1``."""
    return tl.sum(tl.where((rank == k + 1) & (flags != 0), rows, 0), 0)


@triton.jit
def unravel(item, items_per_row, items_per_outer, chunks):
    """``(k, outer, inner, chunk)`` of a work item numbered row-major over
    (k-th fresh row, outer, inner, chunk), ``items_per_outer = inner count * chunks``."""
    k = item // items_per_row
    rest = item - k * items_per_row
    outer = rest // items_per_outer
    rest = rest - outer * items_per_outer
    inner = rest // chunks
    return k, outer, inner, rest - inner * chunks


@triton.jit
def zero_chunk(entry_ptr, slot, start, numel, chunk_words, BLOCK: tl.constexpr):
    """Zero words ``[start, min(start + chunk_words, numel))`` of ``slot`` in the cache whose table
    entry (address, slot stride, slot size) is at ``entry_ptr``."""
    base = tl.load(entry_ptr).to(tl.pointer_type(tl.int32))
    stride = tl.load(entry_ptr + 1)
    end = tl.minimum(start + chunk_words, numel)
    zeros = tl.zeros([BLOCK], dtype=tl.int32)
    for offset in range(start, end, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        tl.store(base + slot * stride + offs, zeros, mask=offs < end)


@triton.jit
def new_row_flags(query_start_ptr, seq_lens_ptr, num_rows, ROWS: tl.constexpr):
    """``(rows, flags)``: ``[ROWS]`` row indices, and int32 1 for the rows that run tokens, all of them
    new (``r < num_rows and 0 < query_len[r] == seq_lens[r]``): they have no state before them."""
    rows = tl.arange(0, ROWS)
    inside = rows < num_rows
    starts = tl.load(query_start_ptr + rows, mask=inside, other=0)
    ends = tl.load(query_start_ptr + rows + 1, mask=inside, other=0)
    seq_lens = tl.load(seq_lens_ptr + rows, mask=inside, other=0)
    query_lens = ends - starts
    return rows, (inside & (query_lens > 0) & (seq_lens == query_lens)).to(tl.int32)


@triton.jit
def zero_fresh_rows_all_kernel(table_ptr, slot_ptr, fresh_ptr, num_rows, num_caches, chunks, chunk_words,
                               ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(programs,)``: ``zero_chunks`` for the rows whose ``fresh`` is set."""
    rows = tl.arange(0, ROWS)
    flags = tl.load(fresh_ptr + rows, mask=rows < num_rows, other=0)
    flags = (flags != 0).to(tl.int32)
    zero_chunks(table_ptr, slot_ptr, 1, 0, 1, rows, flags, num_caches, chunks, chunk_words, BLOCK)


# Row counts and the slot strides vary from step to step: one compiled kernel for all of them.
@triton.jit(do_not_specialize=["slot_stride", "column_stride", "columns", "num_rows"])
def zero_new_rows_all_kernel(table_ptr, slot_ptr, slot_stride, column_stride, columns, query_start_ptr, seq_lens_ptr,
                             num_rows, num_caches, chunks, chunk_words, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(programs,)``: ``zero_chunks`` for the rows that run tokens, all of them new (every slot column)."""
    rows, flags = new_row_flags(query_start_ptr, seq_lens_ptr, num_rows, ROWS)
    zero_chunks(table_ptr, slot_ptr, slot_stride, column_stride, columns, rows, flags, num_caches, chunks,
                chunk_words, BLOCK)


@triton.jit
def _of_group(group, v0, v1, v2, v3, v4, v5, v6, v7):
    """``v<group>``: one group's scalar argument (a kernel takes no list of scalars)."""
    low = tl.where(group == 0, v0, tl.where(group == 1, v1, tl.where(group == 2, v2, v3)))
    high = tl.where(group == 4, v4, tl.where(group == 5, v5, tl.where(group == 6, v6, v7)))
    return tl.where(group < 4, low, high)


# One group's slots: address (bytes), row stride, column stride (elements) and column count, for up to
# eight groups. Row counts, strides and addresses vary from step to step: one compiled kernel for all of them.
@triton.jit(do_not_specialize=["num_rows", "max_columns", "slots0", "row_stride0", "column_stride0",
                               "columns0", "slots1", "row_stride1", "column_stride1", "columns1", "slots2",
                               "row_stride2", "column_stride2", "columns2", "slots3", "row_stride3",
                               "column_stride3", "columns3", "slots4", "row_stride4", "column_stride4",
                               "columns4", "slots5", "row_stride5", "column_stride5", "columns5", "slots6",
                               "row_stride6", "column_stride6", "columns6", "slots7", "row_stride7",
                               "column_stride7", "columns7",])
def zero_new_rows_groups_kernel(table_ptr, query_start_ptr, seq_lens_ptr, num_rows, num_caches, max_columns,
                                chunks, chunk_words, slots0, row_stride0, column_stride0, columns0, slots1,
                                row_stride1, column_stride1, columns1, slots2, row_stride2, column_stride2,
                                columns2, slots3, row_stride3, column_stride3, columns3, slots4, row_stride4,
                                column_stride4, columns4, slots5, row_stride5, column_stride5, columns5,
                                slots6, row_stride6, column_stride6, columns6, slots7, row_stride7,
                                column_stride7, columns7, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                                SLOTS_INT64: tl.constexpr,):
    """Grid ``(programs,)``: ``zero_new_rows_all_kernel`` for up to eight groups of caches in one launch.

    ``table_ptr``: ``[num_caches, 4]`` (address, slot stride, slot size, group); a cache of group ``g``
    takes a new row's slots from group ``g``'s slot tensor (``slots<g>``, an address). Every group
    shares the step's rows (``query_start_ptr``, ``seq_lens_ptr``, ``num_rows``)."""
    rows, flags = new_row_flags(query_start_ptr, seq_lens_ptr, num_rows, ROWS)
    rank = tl.cumsum(flags, 0)
    items_per_cache = max_columns * chunks
    items_per_row = num_caches * items_per_cache
    total = tl.sum(flags, 0) * items_per_row
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        k, cache, column, chunk = unravel(item, items_per_row, items_per_cache, chunks)
        row = kth_fresh_row(rank, flags, rows, k).to(tl.int64)
        group = tl.load(table_ptr + cache * 4 + 3)
        slots = _of_group(group, slots0, slots1, slots2, slots3,
                          slots4, slots5, slots6, slots7)
        row_stride = _of_group(group, row_stride0, row_stride1, row_stride2, row_stride3,
                               row_stride4, row_stride5, row_stride6, row_stride7)
        column_stride = _of_group(group, column_stride0, column_stride1, column_stride2, column_stride3,
                                  column_stride4, column_stride5, column_stride6, column_stride7)
        columns = _of_group(group, columns0, columns1, columns2, columns3,
                            columns4, columns5, columns6, columns7)
        numel = tl.load(table_ptr + cache * 4 + 2)
        start = chunk.to(tl.int64) * chunk_words
        wanted = (column < columns) & (start < numel)  # groups have up to max_columns; small caches fewer chunks
        offset = row * row_stride + column.to(tl.int64) * column_stride
        if SLOTS_INT64:
            slot = tl.load(slots.to(tl.pointer_type(tl.int64)) + offset, mask=wanted, other=-1)
        else:
            slot = tl.load(slots.to(tl.pointer_type(tl.int32)) + offset, mask=wanted, other=-1).to(tl.int64)
        if wanted & (slot >= 0):  # -1: a padding sentinel
            zero_chunk(table_ptr + cache * 4, slot, start, numel, chunk_words, BLOCK)
