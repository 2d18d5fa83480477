"""The fused staging kernel against a naive per-row reference, over a grid of batches.

On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``), on
CUDA natively (``tests/gpu`` runs this module again through ``StagedRowMetadata``
on the device). The reference is written from the definitions in
``gdn_pass/metadata.py``'s docstring, row by row, not from either
implementation.
"""

import importlib
import random

import pytest
import torch

triton = pytest.importorskip("triton")

from gdn_pass.kernels import stage  # noqa: E402

PADS = (-1, 0)


def naive_stage(query_lens, computed, slots, zero_start_rows, max_rows, pads):
    """Per row: (has_initial_state, valid, reads_state, fresh, state_slot)."""
    out = []
    for b in range(max_rows):
        if b >= len(query_lens):
            out.append((False, False, False, False, pads[0]))
            continue
        valid = query_lens[b] > 0 and slots[b] not in pads
        has_init = computed[b] > 0
        starts_from_zero = zero_start_rows[0] <= b < zero_start_rows[1]
        fresh = valid and not has_init and not starts_from_zero
        out.append((has_init, valid, valid and has_init, fresh, slots[b] if valid else pads[0]))
    return out


@pytest.fixture(scope="module")
def interpreted():
    """The kernel module defined again for Triton's CPU interpreter, and again compiled afterwards.

    ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, so the module
    is reloaded with it set; ``stage_rows_fused`` picks the kernel up on its
    next launch.
    """
    from gdn_pass.kernels import _stage_triton

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        importlib.reload(_stage_triton)
        stage._kernel = None
        yield
    importlib.reload(_stage_triton)
    stage._kernel = None


def random_batch(rng, n):
    query_lens = [rng.choice([0, 1, 1, 1, 2, 7]) for _ in range(n)]
    computed = [rng.choice([0, 0, 3, 40]) for _ in range(n)]
    slots = [rng.choice([-1, 0, *range(1, 50)]) for _ in range(n)]
    start = rng.randint(0, n)
    return query_lens, computed, slots, (start, rng.randint(start, n))


@pytest.mark.parametrize("n,max_rows", [(0, 16), (1, 16), (5, 16), (16, 16), (300, 1100), (1100, 1100)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_stage_matches_naive_reference(interpreted, n, max_rows, slot_dtype, seed):
    rng = random.Random(seed * 1000 + n)
    query_lens, computed, slots, zero_start_rows = random_batch(rng, n)
    # Slots as a strided column, the layout of vLLM's speculative slot table.
    slot_table = torch.tensor([[s, 99] for s in slots], dtype=slot_dtype).reshape(n, 2)
    buffers = dict(
        has_initial_state=torch.ones(max_rows, dtype=torch.bool),
        valid=torch.ones(max_rows, dtype=torch.bool),
        reads_state=torch.ones(max_rows, dtype=torch.bool),
        fresh=torch.ones(max_rows, dtype=torch.bool),
        state_slot=torch.full((max_rows,), 12345, dtype=torch.int64),
    )
    flags = stage.row_flags(torch.tensor(query_lens, dtype=torch.int64),
                                   torch.tensor(computed, dtype=torch.int32))
    stage.stage_rows_fused(flags=flags, slots=slot_table[:, 0], zero_start_rows=zero_start_rows,
                                  pad_slot_ids=PADS, **buffers)
    got = list(zip(*(buffers[k].tolist() for k in
                     ("has_initial_state", "valid", "reads_state", "fresh", "state_slot"))))
    assert got == naive_stage(query_lens, computed, slots, zero_start_rows, max_rows, PADS)


def test_one_sentinel_is_passed_twice(interpreted):
    """A layout with one padding sentinel: slot 0 is then a real slot."""
    buffers = {k: torch.zeros(16, dtype=torch.bool) for k in ("has_initial_state", "valid", "reads_state", "fresh")}
    buffers["state_slot"] = torch.zeros(16, dtype=torch.int64)
    stage.stage_rows_fused(flags=stage.row_flags(torch.tensor([1, 1]), torch.tensor([0, 0])),
                                  slots=torch.tensor([0, -1]), zero_start_rows=(0, 0), pad_slot_ids=(-1, -1),
                                  **buffers)
    assert buffers["valid"][:2].tolist() == [True, False]
    assert buffers["fresh"][:2].tolist() == [True, False]
    assert buffers["state_slot"][:2].tolist() == [0, -1]
