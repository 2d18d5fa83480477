"""One launch for every GDN layer's caches: captured once, replayed with
different fresh rows. Caches hold random "previous owners' state" in vLLM's
layouts (a permuted dense conv slot, a recurrent slot inside a larger page);
only the fresh rows' slots of every cache may change.
"""

import random

import pytest
import torch

from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.kernels.zero_rows import CacheTable, zero_rows_all

NUM_SLOTS, MAX_ROWS, LAYERS = 48, 16, 3


def layer_caches():
    conv = torch.randn(NUM_SLOTS, 3, 512, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    pool = torch.randn(NUM_SLOTS, 4 * 32 * 32 + 100, device="cuda")
    ssm = pool[:, : 4 * 32 * 32].view(NUM_SLOTS, 4, 32, 32)
    return conv, ssm, pool


def assert_only_zeroed(layers, before, zeroed: set[int], step: int) -> None:
    """Every layer's slots in ``zeroed`` are all zero (and nothing past them changed); the others as ``before``."""
    for (conv, ssm, pool), (conv0, pool0) in zip(layers, before):
        for s in range(NUM_SLOTS):
            if s in zeroed:
                assert conv[s].eq(0).all() and ssm[s].eq(0).all(), (step, s)
                assert torch.equal(pool[s, 4 * 32 * 32:], pool0[s, 4 * 32 * 32:]), "wrote past the slot"
            else:
                assert torch.equal(conv[s], conv0[s]) and torch.equal(pool[s], pool0[s]), (step, s)


@pytest.mark.parametrize("max_rows", [1, MAX_ROWS, 256])
def test_one_captured_launch_zeroes_fresh_slots_of_every_layer(max_rows):
    layers = [layer_caches() for _ in range(LAYERS)]
    caches = [t for conv, ssm, _ in layers for t in (conv, ssm)]
    table = CacheTable.build(caches)
    assert table is not None and table.table.shape == (2 * LAYERS, 3)
    rows = StagedRowMetadata(max_rows, device="cuda", pad_slot_ids=(-1, 0))
    rows.stage(num_computed_tokens=torch.zeros(1, dtype=torch.int64),
               query_lens=torch.zeros(1, dtype=torch.int64), state_slots=torch.full((1,), -1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        zero_rows_all(table, rows.state_slot, rows.fresh_rows())  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        zero_rows_all(table, rows.state_slot, rows.fresh_rows())

    rng = random.Random(max_rows)
    for step in range(20):
        n = rng.randint(1, min(max_rows, NUM_SLOTS - 1))
        slots = rng.sample(range(1, NUM_SLOTS), n)
        computed = [0 if rng.random() < 0.5 else rng.randint(1, 9) for _ in range(n)]
        qlens = [1 if rng.random() < 0.8 else 0 for _ in range(n)]
        for i in range(n):
            if rng.random() < 0.1:
                slots[i] = rng.choice([-1, 0])
        for conv, _, pool in layers:
            conv.copy_(torch.randn_like(conv.float()).to(conv.dtype))
            pool.copy_(torch.randn_like(pool))
        before = [(conv.clone(), pool.clone()) for conv, _, pool in layers]
        rows.stage(num_computed_tokens=torch.tensor(computed), query_lens=torch.tensor(qlens),
                   state_slots=torch.tensor(slots))
        graph.replay()
        torch.cuda.synchronize()
        fresh = {s for s, c, q in zip(slots, computed, qlens) if c == 0 and q > 0 and s > 0}
        assert_only_zeroed(layers, before, fresh, step)


def test_layouts_the_kernel_does_not_cover_get_no_table():
    sparse = torch.randn(8, 4, 6, device="cuda")[:, :, :5]  # slot elements not dense
    assert CacheTable.build([sparse]) is None
    assert CacheTable.build([torch.randn(8, 3, device="cuda", dtype=torch.bfloat16)]) is None  # 6-byte slot
    assert CacheTable.build([]) is None


def test_captured_launch_with_rows_staged_by_stage_fresh_never_writes_a_negative_slot():
    """The metadata hook stages only the rows to zero (``stage_fresh``: one copy of
    host flags, one slot copy). Replayed over steps whose fresh rows change, the
    captured launch zeroes exactly them; a fresh row naming -1 (vLLM's PAD_SLOT_ID)
    writes nothing, not even the slot before the cache (a guard slot here)."""
    import numpy as np

    guarded = torch.randn(NUM_SLOTS + 1, 4 * 32 * 32, device="cuda")
    cache = guarded[1:].view(NUM_SLOTS, 4, 32, 32)  # slot -1 would land in guarded[0]
    table = CacheTable.build([cache])
    rows = StagedRowMetadata(MAX_ROWS, device="cuda", pad_slot_ids=(-1, 0))
    rows.stage_fresh(fresh_rows=np.zeros(1, dtype=bool), state_slots=torch.full((1,), -1, device="cuda"))
    zero_rows_all(table, rows.state_slot, rows.fresh_rows())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        zero_rows_all(table, rows.state_slot, rows.fresh_rows())
    rng = random.Random(7)
    for step in range(20):
        n = rng.randint(1, MAX_ROWS)
        slots = rng.sample(range(1, NUM_SLOTS), n)
        to_zero = np.array([rng.random() < 0.4 for _ in range(n)])
        if step % 3 == 0:
            slots[0], to_zero[0] = -1, True
        guarded.copy_(torch.randn_like(guarded))
        before = guarded.clone()
        rows.stage_fresh(fresh_rows=to_zero, state_slots=torch.tensor(slots, dtype=torch.int32, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        zeroed = {s for s, z in zip(slots, to_zero) if z and s >= 0}
        assert torch.equal(guarded[0], before[0]), "wrote the slot before the cache"
        for s in range(NUM_SLOTS):
            if s in zeroed:
                assert cache[s].eq(0).all(), (step, s)
            else:
                assert torch.equal(cache[s], before[s + 1].view(4, 32, 32)), (step, s)


@pytest.mark.parametrize("captured", [False, True])
def test_slots_larger_than_a_chunk_and_more_work_than_programs(captured):
    """Recurrent slots of several 64 KiB chunks (and a ragged last one) next to
    one-chunk conv slots; up to every row fresh, so that each program of the
    fixed grid zeroes many chunks. Only the fresh rows' slots change."""
    import numpy as np

    from gdn_pass.kernels import zero_rows as module

    num_slots, max_rows = 160, 128
    words = 3 * module._CHUNK_WORDS + 1000  # three full chunks and a ragged one
    conv = torch.randn(num_slots, 3, 256, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    pool = torch.randn(num_slots, words + 64, device="cuda")
    ssm = pool[:, :words]
    table = CacheTable.build([conv, ssm])
    rows = StagedRowMetadata(max_rows, device="cuda", pad_slot_ids=(-1, 0))
    rows.stage_fresh(fresh_rows=np.zeros(1, dtype=bool), state_slots=torch.full((1,), -1, device="cuda"))
    zero_rows_all(table, rows.state_slot, rows.fresh_rows())
    torch.cuda.synchronize()
    graph = None
    if captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            zero_rows_all(table, rows.state_slot, rows.fresh_rows())
    rng = random.Random(11)
    for step, share in enumerate([0.0, 1 / 128, 0.5, 1.0, 0.25]):
        n = max_rows
        slots = rng.sample(range(1, num_slots), n)
        to_zero = np.array([rng.random() < share for _ in range(n)]) if share < 1 else np.ones(n, dtype=bool)
        if share == 1 / 128:
            to_zero[:] = False
            to_zero[n - 1] = True  # the last row alone
        conv.copy_(torch.randn_like(conv.float()).to(conv.dtype))
        pool.copy_(torch.randn_like(pool))
        conv0, pool0 = conv.clone(), pool.clone()
        rows.stage_fresh(fresh_rows=to_zero, state_slots=torch.tensor(slots, device="cuda"))
        if graph is None:
            zero_rows_all(table, rows.state_slot, rows.fresh_rows())
        else:
            graph.replay()
        torch.cuda.synchronize()
        zeroed = torch.zeros(num_slots, dtype=torch.bool)
        zeroed[[s for s, z in zip(slots, to_zero) if z]] = True
        assert conv[zeroed].eq(0).all() and ssm[zeroed].eq(0).all(), step
        assert torch.equal(pool[zeroed][:, words:], pool0[zeroed][:, words:]), "wrote past the slot"
        assert torch.equal(conv[~zeroed], conv0[~zeroed]) and torch.equal(pool[~zeroed], pool0[~zeroed]), step


@pytest.mark.parametrize("graph_rows", [1, 8, MAX_ROWS])
def test_captured_launch_finds_new_rows_in_vllms_persistent_buffers(graph_rows):
    """``zero_new_rows_all`` as under vLLM's FULL decode graphs: captured once for a
    batch of ``graph_rows`` decodes, reading the builder's persistent slot buffer and
    the runner's ``query_start_loc`` / ``seq_lens``, which each step refreshes in
    place (rows past the step's requests padded: no tokens, slot 0). Each replay
    zeroes exactly the slots of the rows whose one token is their first."""
    from gdn_pass.kernels.zero_rows import zero_new_rows_all

    layers = [layer_caches() for _ in range(LAYERS)]
    table = CacheTable.build([t for conv, ssm, _ in layers for t in (conv, ssm)])
    slots_buf = torch.zeros(MAX_ROWS, dtype=torch.int32, device="cuda")
    starts_buf = torch.zeros(MAX_ROWS + 1, dtype=torch.int32, device="cuda")
    seq_lens_buf = torch.zeros(MAX_ROWS, dtype=torch.int32, device="cuda")
    args = (table, slots_buf[:graph_rows], starts_buf[: graph_rows + 1], seq_lens_buf[:graph_rows], graph_rows, MAX_ROWS)
    zero_new_rows_all(*args)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        zero_new_rows_all(*args)
    rng = random.Random(graph_rows)
    for step in range(20):
        n = rng.randint(1, graph_rows)
        slots = rng.sample(range(1, NUM_SLOTS), n) + [0] * (graph_rows - n)
        new = [r < n and rng.random() < 0.4 for r in range(graph_rows)]
        seq_lens = [(1 if new[r] else rng.randint(2, 99)) if r < n else 0 for r in range(graph_rows)]
        starts = [min(r, n) for r in range(graph_rows + 1)]
        slots_buf[:graph_rows].copy_(torch.tensor(slots, dtype=torch.int32))
        starts_buf[: graph_rows + 1].copy_(torch.tensor(starts, dtype=torch.int32))
        seq_lens_buf[:graph_rows].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        for conv, _, pool in layers:
            conv.copy_(torch.randn_like(conv.float()).to(conv.dtype))
            pool.copy_(torch.randn_like(pool))
        before = [(conv.clone(), pool.clone()) for conv, _, pool in layers]
        graph.replay()
        torch.cuda.synchronize()
        assert_only_zeroed(layers, before, {s for s, f in zip(slots, new) if f}, step)


def test_launches_after_the_first_go_through_the_c_launcher_and_zero_the_same_rows():
    """``zero_new_rows_all`` eagerly, step after step, as the step guard launches it: slots of
    int32 and int64, 1-D and ``[rows, 1 + k]`` (MTP: every column of a fresh row zeroed in
    the one launch), a column of a wider block table (an address that is not 16-byte
    aligned: another compiled kernel), row counts that change. After a layout's first
    launch the launch skips Triton's binder (``fast_launch``); each step must zero exactly
    the fresh rows' slots of every column and layer, as a naive reference says."""
    from gdn_pass.kernels import zero_rows
    from gdn_pass.kernels.zero_rows import zero_new_rows_all

    layers = [layer_caches() for _ in range(LAYERS)]
    table = CacheTable.build([t for conv, ssm, _ in layers for t in (conv, ssm)])
    rng = random.Random(7)
    layouts = [("1-D int32", torch.int32, 1, 1), ("1-D int64", torch.int64, 1, 1),
               ("[rows, 2] int32", torch.int32, 2, 2), ("[rows, 3] of a 4-wide table", torch.int32, 3, 4),
               ("column 1 of a 3-wide table", torch.int32, 1, 3)]
    for step in range(40):
        name, dtype, columns, width = layouts[step % len(layouts)]
        n = rng.randint(1, MAX_ROWS)
        picked = rng.sample(range(NUM_SLOTS), n * columns)
        table_of_slots = torch.full((MAX_ROWS, width), -1, dtype=dtype)
        first = 1 if name.startswith("column 1") else 0
        for r in range(n):
            table_of_slots[r, first:first + columns] = torch.tensor(picked[r * columns:(r + 1) * columns])
        table_of_slots = table_of_slots.cuda()
        slot = table_of_slots[:, first] if columns == 1 and width > 1 else (
            table_of_slots[:, 0] if columns == 1 else table_of_slots[:, :columns])
        new = [r < n and rng.random() < 0.4 for r in range(MAX_ROWS)]
        seq_lens = torch.tensor([(1 if new[r] else rng.randint(2, 99)) if r < n else 0 for r in range(MAX_ROWS)],
                                dtype=torch.int32, device="cuda")
        starts = torch.tensor([min(r, n) for r in range(MAX_ROWS + 1)], dtype=torch.int32, device="cuda")
        for conv, _, pool in layers:
            conv.copy_(torch.randn_like(conv.float()).to(conv.dtype))
            pool.copy_(torch.randn_like(pool))
        before = [(conv.clone(), pool.clone()) for conv, _, pool in layers]
        zero_new_rows_all(table, slot, starts, seq_lens, n, MAX_ROWS)
        torch.cuda.synchronize()
        zeroed = {picked[r * columns + c] for r in range(n) if new[r] for c in range(columns)}
        assert_only_zeroed(layers, before, zeroed, f"{step} ({name})")
    launcher = zero_rows._new_rows_kernel
    assert launcher.fast_launches >= 40 - 2 * len(layouts), (launcher.fast_launches, launcher.triton_launches)


@pytest.mark.parametrize("groups", [1, 3, 5, 9])
def test_one_launch_zeroes_the_new_rows_of_every_group(groups):
    """``zero_new_rows_groups`` natively, step after step, as the op guard launches it for a step's
    groups (a 48-layer Qwen3-Next has three, the 12-layer Bailing engine five): each group's own
    caches and slot tensor (a column of its own block table; group 1's ``[rows, 2]``), one step's
    rows for all, int32 and int64 slots.
    Each step must zero exactly each group's new rows' slots in that group's caches, as a naive
    reference says; nine groups take two launches; after a layout's first launch the launch
    skips Triton's binder."""
    from gdn_pass.kernels import zero_rows
    from gdn_pass.kernels.zero_rows import zero_new_rows_groups

    group_layers = [[layer_caches() for _ in range(2)] for _ in range(groups)]
    tables = [CacheTable.build([t for conv, ssm, _ in layers for t in (conv, ssm)]) for layers in group_layers]
    rng = random.Random(groups)
    for step in range(24):
        dtype = (torch.int32, torch.int64)[step % 2]
        n = rng.randint(1, MAX_ROWS)
        columns = [2 if g == 1 else 1 for g in range(groups)]
        picked = [rng.sample(range(NUM_SLOTS), n * c) for c in columns]
        slot_tensors = []
        for g, c in enumerate(columns):
            block_table = torch.full((MAX_ROWS, 3), -1, dtype=dtype)
            for r in range(n):
                block_table[r, :c] = torch.tensor(picked[g][r * c:(r + 1) * c])
            block_table = block_table.cuda()
            slot_tensors.append(block_table[:, 0] if c == 1 else block_table[:, :c])
        new = [r < n and rng.random() < 0.4 for r in range(MAX_ROWS)]
        seq_lens = torch.tensor([(1 if new[r] else rng.randint(2, 99)) if r < n else 0 for r in range(MAX_ROWS)],
                                dtype=torch.int32, device="cuda")
        starts = torch.tensor([min(r, n) for r in range(MAX_ROWS + 1)], dtype=torch.int32, device="cuda")
        for layers in group_layers:
            for conv, _, pool in layers:
                conv.copy_(torch.randn_like(conv.float()).to(conv.dtype))
                pool.copy_(torch.randn_like(pool))
        before = [[(conv.clone(), pool.clone()) for conv, _, pool in layers] for layers in group_layers]
        launches = zero_new_rows_groups(tables, slot_tensors, starts, seq_lens, n, MAX_ROWS)
        torch.cuda.synchronize()
        assert launches == -(-groups // zero_rows.MAX_GROUPS)
        for g, layers in enumerate(group_layers):
            zeroed = {picked[g][r * columns[g] + c] for r in range(n) if new[r] for c in range(columns[g])}
            assert_only_zeroed(layers, before[g], zeroed, f"{step}, group {g}")
    launcher = zero_rows._groups_kernel
    assert launcher.fast_launches >= launcher.triton_launches, (launcher.fast_launches, launcher.triton_launches)
