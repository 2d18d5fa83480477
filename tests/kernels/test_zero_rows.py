"""The group zeroing kernels (``zero_rows_all``, ``zero_new_rows_all``) against a naive per-row reference, on CPU.

The kernel runs in Triton's interpreter on CPU tensors, in a subprocess
started with ``TRITON_INTERPRET=1``: the interpreter must be on before
Triton's own library functions (``tl.cumsum``, ``tl.sum``) are defined, and
this process imported Triton long before. ``tests/gpu/test_zero_rows_all.py``
runs the kernel natively, captured and replayed. Chunks are made small here,
so that a slot spans several of them (the last one ragged) and the fixed grid
has fewer programs than work items. The caches hold random "previous owners'
state": a slot may change only if its row is fresh and names a real
(non-negative) slot, and then all of it becomes zero. For ``zero_new_rows_all``
a row is fresh when it is one of the first ``num_rows`` and runs tokens, all of
them new (``seq_len == query_len``), with its slot read from a column of a
block table (vLLM's ``non_spec_state_indices_tensor`` outside FULL graphs).
"""

import json
import random

import pytest
import torch

from tests.triton_interpreter import run_in_interpreter
from tests.vllm.cuda_zeroing import cpu_table

pytest.importorskip("triton")

from gdn_pass.kernels import zero_rows  # noqa: E402
from gdn_pass.kernels.zero_rows import zero_new_rows_all, zero_new_rows_groups, zero_rows_all  # noqa: E402

NUM_SLOTS = 40
RECURRENT_WORDS = 700  # 11 chunks of 64 words, the last one ragged
# (max_rows, programs in the grid, share of rows fresh)
CASES = [(1, 1, 1.0), (5, 3, 0.5), (16, 8, 0.0), (33, 3, 0.5), (33, 7, 1.0), (40, 2, 0.25)]


def check_case(max_rows: int, programs: int, share: float) -> list[str]:
    """Three steps of one case; what went wrong (nothing: ``[]``). Run with the interpreter on."""
    zero_rows._programs = lambda device: programs
    zero_rows._CHUNK_WORDS = 64
    rng = random.Random(max_rows * 100 + programs)
    flat = torch.randn(NUM_SLOTS + 1, 3 * 40).to(torch.bfloat16)  # row 0: the memory before slot 0
    conv = flat[1:].view(NUM_SLOTS, 3, 40).transpose(1, 2)  # vLLM's permuted dense conv slot
    pool = torch.randn(NUM_SLOTS, RECURRENT_WORDS + 13)  # a recurrent slot inside a larger page
    recurrent = pool[:, :RECURRENT_WORDS]
    table = cpu_table([conv, recurrent])
    errors = []
    for step in range(3):
        n = rng.randint(1, max_rows)
        slots = rng.sample(range(NUM_SLOTS), n) + [-1] * (max_rows - n)
        fresh = [i < n and rng.random() < share for i in range(max_rows)]
        if step == 1 and n > 1:
            slots[0], fresh[0] = -1, True  # vLLM's PAD_SLOT_ID on a fresh row: writes nothing
        flat.copy_(torch.randn(flat.shape).to(torch.bfloat16))
        pool.copy_(torch.randn(pool.shape))
        old_flat, old_pool = flat.clone(), pool.clone()
        zero_rows_all(table, torch.tensor(slots), torch.tensor(fresh))
        zeroed = {s for s, f in zip(slots, fresh) if f and s >= 0}  # the reference, row by row
        if not torch.equal(flat[0], old_flat[0]):
            errors.append(f"step {step}: wrote the memory before slot 0")
        for s in range(NUM_SLOTS):
            if s in zeroed:
                if not (conv[s].eq(0).all() and recurrent[s].eq(0).all()):
                    errors.append(f"step {step}: fresh slot {s} not zeroed")
                if not torch.equal(pool[s, RECURRENT_WORDS:], old_pool[s, RECURRENT_WORDS:]):
                    errors.append(f"step {step}: wrote past slot {s}")
            elif not (torch.equal(flat[s + 1], old_flat[s + 1]) and torch.equal(pool[s], old_pool[s])):
                errors.append(f"step {step}: slot {s} changed, not fresh")
    return errors


def check_new_rows_case(max_rows: int, programs: int, share: float, columns: int = 1) -> list[str]:
    """``zero_new_rows_all``: three steps of one case; what went wrong. Run with the interpreter on.

    ``columns`` > 1: the slots are ``[rows, columns]`` (a speculative builder's ``1 + k`` slots
    per row, its own blocks): every column of a new row is zeroed."""
    zero_rows._programs = lambda device: programs
    zero_rows._CHUNK_WORDS = 64
    rng = random.Random(max_rows * 1000 + programs)
    num_slots = NUM_SLOTS * columns
    pool = torch.randn(num_slots + 1, RECURRENT_WORDS + 13)  # row 0: the memory before slot 0
    recurrent = pool[1:, :RECURRENT_WORDS]
    table = cpu_table([recurrent])
    errors = []
    for step in range(3):
        padded = rng.randint(1, max_rows)  # the step's rows, padding included
        real = rng.randint(0, padded)  # padding rows run no tokens
        decodes = rng.randint(0, real)  # the rows on the decode path come first
        row_slots = rng.sample(range(num_slots), padded * columns)
        slots = [row_slots[r * columns : (r + 1) * columns] for r in range(padded)]
        query_lens = [rng.choice([1, 1, 1, 3]) if r < real else 0 for r in range(padded)]
        new = [r < real and rng.random() < share for r in range(padded)]  # no token computed before
        seq_lens = [q if n else q + rng.randint(1, 50) for q, n in zip(query_lens, new)]
        if step == 1 and decodes:
            slots[0], new[0], seq_lens[0] = [-1] * columns, True, query_lens[0]  # a new row naming PAD_SLOT_ID
        block_table = torch.tensor([[*s, 7, 7] for s in slots], dtype=torch.int32)
        starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        pool.copy_(torch.randn(pool.shape))
        old = pool.clone()
        slot = block_table[:, 0] if columns == 1 else block_table[:, :columns]
        zero_new_rows_all(table, slot, starts, torch.tensor(seq_lens, dtype=torch.int32), decodes, max_rows)
        zeroed = {s for r, row in enumerate(slots) for s in row
                  if r < decodes and query_lens[r] > 0 and seq_lens[r] == query_lens[r] and s >= 0}
        if not torch.equal(pool[0], old[0]):
            errors.append(f"step {step}: wrote the memory before slot 0")
        for s in range(num_slots):
            if s in zeroed:
                if not recurrent[s].eq(0).all():
                    errors.append(f"step {step}: new row's slot {s} not zeroed")
                if not torch.equal(pool[s + 1, RECURRENT_WORDS:], old[s + 1, RECURRENT_WORDS:]):
                    errors.append(f"step {step}: wrote past slot {s}")
            elif not torch.equal(pool[s + 1], old[s + 1]):
                errors.append(f"step {step}: slot {s} changed, not a new decode row")
    return errors


def check_groups_case(max_rows: int, programs: int, share: float, groups: int = 3) -> list[str]:
    """``zero_new_rows_groups``: three steps of one case over ``groups`` groups of caches, each with
    its own slot tensor (a column of its own block table; group 1's ``[rows, 2]``, a speculative
    builder's; group 2's ``[rows, 1]``, with more columns beside it in the block table), sharing the
    step's rows; what went wrong. Run with the interpreter on."""
    zero_rows._programs = lambda device: programs
    zero_rows._CHUNK_WORDS = 64
    rng = random.Random(max_rows * 10000 + programs * 10 + groups)
    columns = [2 if g == 1 else 1 for g in range(groups)]
    pools = [torch.randn(NUM_SLOTS * 2 + 1, RECURRENT_WORDS + 13) for _ in range(groups)]  # row 0: before slot 0
    convs = [torch.randn(NUM_SLOTS * 2, 5, 3) for _ in range(groups)]  # a small second cache per group
    tables = [cpu_table([pool[1:, :RECURRENT_WORDS], conv]) for pool, conv in zip(pools, convs)]
    errors = []
    for step in range(3):
        padded = rng.randint(1, max_rows)
        real = rng.randint(0, padded)
        decodes = rng.randint(0, real)
        query_lens = [rng.choice([1, 1, 1, 3]) if r < real else 0 for r in range(padded)]
        new = [r < real and rng.random() < share for r in range(padded)]
        seq_lens = [q if n else q + rng.randint(1, 50) for q, n in zip(query_lens, new)]
        slots = []  # per group, per row: its columns' slots (each group's blocks of its own)
        for g in range(groups):
            flat = rng.sample(range(NUM_SLOTS * 2), padded * columns[g])
            slots.append([flat[r * columns[g] : (r + 1) * columns[g]] for r in range(padded)])
        if step == 1 and decodes:
            slots[0][0], new[0], seq_lens[0] = [-1] * columns[0], True, query_lens[0]  # PAD_SLOT_ID in group 0
        slot_tensors = []
        for g in range(groups):
            block_table = torch.tensor([[*row, 7, 7, 7] for row in slots[g]], dtype=torch.int32)
            # group 2: one column as a 2-D view, whose neighbor column (slot 7) a new row must not zero
            slot_tensors.append(block_table[:, 0] if columns[g] == 1 and g != 2 else block_table[:, : columns[g]])
        starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        for pool, conv in zip(pools, convs):
            pool.copy_(torch.randn(pool.shape))
            conv.copy_(torch.randn(conv.shape))
        old = [(pool.clone(), conv.clone()) for pool, conv in zip(pools, convs)]
        launches = zero_new_rows_groups(tables, slot_tensors, starts, torch.tensor(seq_lens, dtype=torch.int32),
                                        decodes, max_rows)
        if launches != -(-groups // zero_rows.MAX_GROUPS):
            errors.append(f"step {step}: {launches} launches for {groups} groups")
        for g in range(groups):
            zeroed = {s for r, row in enumerate(slots[g]) for s in row
                      if r < decodes and query_lens[r] > 0 and seq_lens[r] == query_lens[r] and s >= 0}
            pool, conv = pools[g], convs[g]
            if not torch.equal(pool[0], old[g][0][0]):
                errors.append(f"step {step}: group {g} wrote the memory before slot 0")
            for s in range(NUM_SLOTS * 2):
                if s in zeroed:
                    if not (pool[s + 1, :RECURRENT_WORDS].eq(0).all() and conv[s].eq(0).all()):
                        errors.append(f"step {step}: group {g}'s new row slot {s} not zeroed")
                    if not torch.equal(pool[s + 1, RECURRENT_WORDS:], old[g][0][s + 1, RECURRENT_WORDS:]):
                        errors.append(f"step {step}: group {g} wrote past slot {s}")
                elif not (torch.equal(pool[s + 1], old[g][0][s + 1]) and torch.equal(conv[s], old[g][1][s])):
                    errors.append(f"step {step}: group {g}'s slot {s} changed, not a new decode row")
    return errors


@pytest.fixture(scope="module")
def interpreted_results():
    return run_in_interpreter(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rows{c[0]}-programs{c[1]}-fresh{c[2]}")
def test_fresh_slots_of_every_cache_and_nothing_else(interpreted_results, case):
    assert interpreted_results[json.dumps(case)] == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rows{c[0]}-programs{c[1]}-new{c[2]}")
def test_new_decode_rows_found_in_vllms_lengths(interpreted_results, case):
    assert interpreted_results["new " + json.dumps(case)] == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rows{c[0]}-programs{c[1]}-new{c[2]}")
def test_every_slot_column_of_a_new_row(interpreted_results, case):
    assert interpreted_results["new2 " + json.dumps(case)] == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rows{c[0]}-programs{c[1]}-new{c[2]}")
def test_new_rows_of_several_groups_in_one_launch(interpreted_results, case):
    assert interpreted_results["groups " + json.dumps(case)] == []


def test_as_many_groups_as_one_launch_takes(interpreted_results):
    assert interpreted_results["groups8"] == []


def test_more_groups_than_one_launch_takes(interpreted_results):
    assert interpreted_results["groups9"] == []


def test_groups_slots_must_share_a_dtype():
    tables = [cpu_table([torch.zeros(4, 64)]) for _ in range(2)]
    starts, lens = torch.zeros(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="one dtype"):
        zero_new_rows_groups(tables, [torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)],
                             starts, lens, 2, 4)
    with pytest.raises(ValueError, match="2 cache tables for 1 slot tensors"):
        zero_new_rows_groups(tables, [torch.zeros(2, dtype=torch.int32)], starts, lens, 2, 4)


def test_new_rows_must_fit_the_row_block():
    table = cpu_table([torch.zeros(4, 64)])
    starts, lens = torch.zeros(6, dtype=torch.int32), torch.ones(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="5 rows do not fit max_rows=4"):
        zero_new_rows_all(table, torch.zeros(5, dtype=torch.int32), starts, lens, 5, 4)


def test_fresh_and_slot_rows_must_agree(monkeypatch):
    monkeypatch.setattr(zero_rows, "_multi_kernel", object())  # never launched
    table = cpu_table([torch.zeros(4, 64)])
    with pytest.raises(ValueError, match="fresh has 3 rows, slot 4"):
        zero_rows_all(table, torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.bool))


if __name__ == "__main__":  # the subprocess: every case, its errors as one JSON line
    results = {json.dumps(case): check_case(*case) for case in CASES}
    results.update({"new " + json.dumps(case): check_new_rows_case(*case) for case in CASES})
    results.update({"new2 " + json.dumps(case): check_new_rows_case(*case, columns=2) for case in CASES})
    results.update({"groups " + json.dumps(case): check_groups_case(*case) for case in CASES})
    results["groups8"] = check_groups_case(9, 4, 0.5, groups=zero_rows.MAX_GROUPS)
    results["groups9"] = check_groups_case(9, 4, 0.5, groups=zero_rows.MAX_GROUPS + 1)
    print(json.dumps(results))


def test_merged_tables_are_kept_without_keeping_the_caches():
    """The groups' merged table is made once per set of tables; holding it must not keep an engine's
    caches (inside its tables) alive once the engine drops them."""
    import gc
    import weakref

    tables = [cpu_table([torch.zeros(4, 64)]), cpu_table([torch.zeros(4, 32), torch.zeros(4, 16)])]
    merged, caches, words = zero_rows._merged_table(tables)
    assert (caches, words) == (3, 64)
    assert merged[:, 3].tolist() == [0, 1, 1] and merged[:, :3].tolist() == torch.cat([t.table for t in tables]).tolist()
    assert zero_rows._merged_table(tables)[0] is merged  # found again, not rebuilt
    gone = weakref.ref(tables[1].caches[0])
    del tables
    gc.collect()
    assert gone() is None, "the merged tables kept a cache alive"
