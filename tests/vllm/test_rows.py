"""``rows.has_new_rows`` and ``rows.scheduler_rows`` against a naive per-row reference.

The reference reads the test's own per-row inputs (tokens computed before the
step, tokens this step), never the lengths the code under test reads:

    new[i] = query_len[i] > 0 and computed[i] == 0

The steps are built as vLLM's runners build them: ``query_start_loc_cpu``
with ``num_reqs + 1`` offsets, host lengths in one of the three fields vLLM
0.26-0.33 carry (sequence lengths, their upper bound, or tokens computed),
and full-graph padding rows (no token, length 0) past ``num_reqs``.
"""

from __future__ import annotations

import copy
import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gdn_pass.vllm import rows
from gdn_pass.vllm.builders import gdn

FIELDS = ("seq_lens_cpu_upper_bound", "seq_lens_cpu", "num_computed_tokens_cpu")


def step(computed: list[int], query_lens: list[int], field: str, *, padding: int = 0, padded_num_reqs=False):
    """One step's scheduler metadata with its host lengths in ``field`` (a new view per call).

    ``padding`` rows without tokens follow the real ones; ``padded_num_reqs``: ``num_reqs`` counts
    them, as vLLM 0.27-0.32's V1 runner does for a padded FULL CUDA graph."""
    num_reqs = len(query_lens) + (padding if padded_num_reqs else 0)
    lens = [c + q for c, q in zip(computed, query_lens)] if field != "num_computed_tokens_cpu" else list(computed)
    starts = torch.tensor([0] + query_lens + [0] * padding, dtype=torch.int32).cumsum(0).to(torch.int32)
    lengths = torch.tensor(lens + [0] * padding, dtype=torch.int32)
    return SimpleNamespace(query_start_loc_cpu=starts[:], num_reqs=num_reqs, max_query_len=max(query_lens, default=0),
                           **{field: lengths[:]})


def reference_has_new(computed: list[int], query_lens: list[int]) -> bool:
    return any(q > 0 and c == 0 for c, q in zip(computed, query_lens))


def random_steps(seed: int):
    """Decode, speculative and mixed steps of 1-256 rows; 0, 1 or several new rows, some at the bound."""
    rng = random.Random(seed)
    for batch, max_query_len, num_new in itertools.product((1, 3, 64, 256), (1, 2, 4, 17), (0, 1, 3)):
        query_lens = [rng.randint(1, max_query_len) for _ in range(batch)]
        computed = [rng.randint(1, 40) for _ in range(batch)]
        query_lens[rng.randrange(batch)] = max_query_len
        for row in rng.sample(range(batch), min(num_new, batch)):
            computed[row] = 0
        yield computed, query_lens


@pytest.fixture(autouse=True)
def forget_last_step(monkeypatch):
    monkeypatch.setattr(rows, "_last_step", [None])
    monkeypatch.setattr(rows, "_last_idle_key", [None])


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("padding, padded_num_reqs", [(0, False), (5, False), (5, True)])
def test_has_new_rows_matches_the_reference(field, padding, padded_num_reqs):
    cases = list(random_steps(seed=len(field) + padding))
    for computed, query_lens in cases:
        expected = reference_has_new(computed, query_lens)
        kw = dict(padding=padding, padded_num_reqs=padded_num_reqs)
        assert rows.has_new_rows(step(computed, query_lens, field, **kw)) == expected, (computed, query_lens)
        assert (rows.scheduler_rows(step(computed, query_lens, field, **kw)).num_new != 0) == expected


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(
    "computed, query_lens, expected",
    [
        ([7, 0, 9], [1, 1, 1], True),  # the bug's step: a new one-token row among decodes
        ([7, 1, 9], [1, 1, 1], False),  # a length equal to the step's longest query, yet not new
        ([0], [1], True),
        ([5, 0], [3, 3], True),  # a new row exactly at max_query_len
        ([5, 2], [3, 1], False),
        ([0, 4], [0, 1], False),  # a row without tokens is not new
        ([0, 0, 6], [0, 1, 1], True),  # a row without tokens (length 0) ahead of a new row
        ([3, 0, 0], [1, 0, 1], True),
        ([], [], False),  # no row at all
    ],
)
def test_has_new_rows_at_the_bound(field, computed, query_lens, expected):
    assert reference_has_new(computed, query_lens) == expected
    assert rows.has_new_rows(step(computed, query_lens, field)) == expected
    assert rows.has_new_rows(step(computed, query_lens, field, padding=3)) == expected
    assert rows.has_new_rows(step(computed, query_lens, field, padding=3, padded_num_reqs=True)) == expected


@pytest.mark.parametrize("max_query_len", [1, 2])
@pytest.mark.parametrize("padded_num_reqs", [False, True])
def test_a_step_without_new_rows_is_proven_without_its_scheduler_rows(monkeypatch, padded_num_reqs, max_query_len):
    """The cost: on a decode step whose rows all have history the answer is one reduction, not the
    step's rows, FULL-graph padding rows counted in ``num_reqs`` included; the step's other groups
    (shallow copies) reuse the answer."""
    common = step([30, 12, 5], [1, max_query_len, 1], "seq_lens_cpu_upper_bound", padding=2,
                  padded_num_reqs=padded_num_reqs)
    monkeypatch.setattr(rows, "scheduler_rows", lambda c: pytest.fail("scheduler rows computed"))
    assert rows.has_new_rows(common) is False
    monkeypatch.setattr(rows, "host_lengths", lambda c: pytest.fail("lengths read again"))
    assert rows.has_new_rows(copy.copy(common)) is False


def test_lengths_refilled_in_place_are_a_new_step():
    """A caller refilling the same host tensor with torch ops (its version counter moves) gets a fresh
    answer: a row that becomes new in the later step is seen."""
    common = step([30, 12, 5], [1, 1, 1], "seq_lens_cpu")
    assert rows.has_new_rows(common) is False
    common.seq_lens_cpu[1] = 1  # row 1 now has its one token and none computed
    assert rows.has_new_rows(common) is True


def test_inference_tensors_refilled_in_place_are_a_new_step():
    """vLLM 0.34's V2 runner makes its host tensors under ``inference_mode``: they keep no version
    counter, so an in-place refill cannot be told from the step before; nothing is reused for them
    (the first build of such a step used to raise "Inference tensors do not track version counter")."""
    with torch.inference_mode():
        common = step([30, 12, 5], [1, 1, 1], "seq_lens_cpu")
        assert common.seq_lens_cpu.is_inference()
        assert rows.has_new_rows(common) is False
        assert rows.scheduler_rows(common).num_new == 0
        common.seq_lens_cpu[1] = 1  # the same tensor object refilled: row 1 is new now
        assert rows.has_new_rows(common) is True
        assert rows.scheduler_rows(common).new.tolist() == [False, True, False]
    assert rows.has_new_rows(step([30, 0], [1, 1], "seq_lens_cpu")) is True  # outside inference mode too


def test_once_an_inference_host_tensor_was_met_the_key_asks_first_and_other_tensors_still_get_keys(monkeypatch):
    """The first inference host tensor's version read raises (about 6 us); from then on ``_step_key``
    asks ``is_inference()`` instead. Host tensors that keep a version counter still get their key,
    and a step of them is still found again by identity."""
    monkeypatch.setattr(rows, "_inference_host", [False])
    with torch.inference_mode():
        inference = step([30, 12, 5], [1, 1, 1], "seq_lens_cpu")
    for _ in range(2):
        tensor, field = rows.host_lengths(inference)
        assert rows._step_key(inference, inference.query_start_loc_cpu, tensor, field) is None
        assert rows._inference_host == [True]
    common = step([30, 12, 5], [1, 1, 1], "seq_lens_cpu")
    tensor, field = rows.host_lengths(common)
    key = rows._step_key(common, common.query_start_loc_cpu, tensor, field)
    assert key is not None and key[0] is common.query_start_loc_cpu and key[2] is tensor
    assert rows.has_new_rows(common) is False
    monkeypatch.setattr(rows, "host_lengths", lambda c: pytest.fail("lengths read again"))
    assert rows.has_new_rows(copy.copy(common)) is False  # a later group of the step: by identity


def test_inference_tensors_rows_are_computed_once_per_build_and_not_kept_for_the_next(monkeypatch):
    """Without version counters nothing is reused across builds, but within one build the hook asks
    twice (``has_new_rows``, then the entry's ``stage_step``): the rows are computed once there. The
    next build (``has_new_rows`` first) computes them again, so a refill in place is seen."""
    computed_calls = []
    real = rows.num_computed_tokens
    monkeypatch.setattr(rows, "num_computed_tokens", lambda *a: computed_calls.append(1) or real(*a))
    with torch.inference_mode():
        common = step([30, 0, 5], [1, 1, 1], "seq_lens_cpu")
        assert rows.has_new_rows(common) is True
        first = rows.scheduler_rows(common)
        assert first.new.tolist() == [False, True, False] and len(computed_calls) == 1
        common.seq_lens_cpu[1] = 13  # the same tensors refilled in place: no row is new now
        assert rows.has_new_rows(common) is False
        assert rows.scheduler_rows(common).num_new == 0 and len(computed_calls) == 2
        rows.forget_build_rows()
        assert rows.scheduler_rows(common) is not first and len(computed_calls) == 3


@pytest.mark.parametrize("new_row", [True, False], ids=["new_row", "no_new_row"])
def test_builds_of_one_step_read_its_rows_once(monkeypatch, new_row):
    """Inside ``one_step`` (a guarded op resolving one step's deferred builds) the first build's answer
    holds for the step's later builds, though their inference tensors cannot say they are one step's:
    the host lengths are read once, not once per group. After it, a refill in place is seen again."""
    monkeypatch.setattr(rows, "_one_step", [False, None])
    reads = []
    real = rows.host_lengths
    monkeypatch.setattr(rows, "host_lengths", lambda c: reads.append(1) or real(c))
    with torch.inference_mode():
        common = step([30, 0 if new_row else 4, 5], [1, 1, 1], "seq_lens_cpu")
    reads_per_build = []
    rows.one_step(True)
    try:
        for group in range(3):
            build = copy.copy(common)  # each group's metadata: a shallow copy of the step's
            assert rows.has_new_rows(build) is new_row, f"group {group}"
            if new_row:
                assert rows.scheduler_rows(build).new.tolist() == [False, True, False]
                assert rows.scheduler_rows(build).new_among_first(1) == 0
                assert rows.scheduler_rows(build).new_among_first(2) == 1
                assert rows.scheduler_rows(build).new_among_first(3) == 1
                assert rows.scheduler_rows(build).new_among_first(8) == 1  # past the step's rows
            reads_per_build.append(len(reads) - sum(reads_per_build))
    finally:
        rows.one_step(False)
    assert reads_per_build[0] > 0 and reads_per_build[1:] == [0, 0], \
        f"host lengths read per build: {reads_per_build} (the later groups must read none)"
    with torch.inference_mode():
        common.seq_lens_cpu[1] = 1 if not new_row else 13  # refilled in place: the answer flips
    before = len(reads)
    assert rows.has_new_rows(common) is not new_row
    assert len(reads) > before, "after one_step a build reads its step again"


def test_decode_rows_only_where_vllms_own_tensors_say_which_rows_are_new():
    """``decode_rows`` hands the zeroing launch vLLM's tensors only on steps without
    speculative rows whose tensors cover the decode rows; otherwise
    None, and the metadata hook stages the rows itself."""
    from types import SimpleNamespace

    import torch

    common = SimpleNamespace(seq_lens=torch.tensor([5, 1, 0], dtype=torch.int32))

    def metadata(**fields):
        base = dict(spec_sequence_masks=None, num_decodes=2,
                    non_spec_state_indices_tensor=torch.tensor([[4, 0], [6, 0], [0, 0]], dtype=torch.int32)[:, 0],
                    non_spec_query_start_loc=torch.tensor([0, 1, 2, 2], dtype=torch.int32))
        return SimpleNamespace(**{**base, **fields})

    found = gdn.gdn_decode_rows(common, metadata())
    assert found is not None and found.num_rows == 2 and found.slots.tolist() == [4, 6, 0]
    assert gdn.gdn_decode_rows(common, metadata(spec_sequence_masks=torch.tensor([True, False, False]))) is None
    assert gdn.gdn_decode_rows(common, metadata(non_spec_state_indices_tensor=None)) is None
    assert gdn.gdn_decode_rows(common, metadata(num_decodes=4)) is None  # more rows than lengths
    assert gdn.gdn_decode_rows(SimpleNamespace(), metadata()) is None
    assert gdn.gdn_decode_rows(common, metadata(non_spec_query_start_loc=torch.zeros(2, dtype=torch.int32))) is None


def _reference(tensor: torch.Tensor, num_reqs: int) -> list[int]:
    return tensor.tolist()[:num_reqs]


def test_host_array_reads_views_of_one_buffer_as_the_runner_refills_it(monkeypatch):
    monkeypatch.setattr(rows, "_host_arrays", {})
    buffer = torch.zeros(64, dtype=torch.int32)  # a runner's persistent host buffer
    for step, num_reqs in enumerate([1, 8, 64, 5, 64, 3]):
        buffer[:num_reqs] = torch.arange(num_reqs, dtype=torch.int32) + 100 * step  # this step's lengths
        view = buffer[:num_reqs]  # a new view object every step
        assert rows.host_array(view, num_reqs).tolist() == _reference(view, num_reqs)
        # asked for fewer rows than the view has (padding left out), and for more (the view's length)
        assert rows.host_array(view, num_reqs - 1).tolist() == _reference(view, num_reqs - 1)
        assert rows.host_array(view, num_reqs + 7).tolist() == _reference(view, num_reqs + 7)


def test_host_array_tells_apart_tensors_at_one_address():
    base = torch.arange(32, dtype=torch.int32)
    strided, as_int16 = base[::2], base.view(torch.int16)
    for tensor in (base[:16], strided, as_int16, base[:16], strided, as_int16):
        assert tensor.data_ptr() == base.data_ptr()
        assert rows.host_array(tensor, 16).tolist() == _reference(tensor, 16)


def test_host_array_with_new_arrays_every_step_starts_over(monkeypatch):
    monkeypatch.setattr(rows, "_host_arrays", {})
    for step in range(3 * rows._HOST_ARRAYS_KEPT):  # a runner that makes new host arrays (torch.from_numpy)
        tensor = torch.from_numpy(np.arange(step, step + 9, dtype=np.int32))
        assert rows.host_array(tensor, 9).tolist() == _reference(tensor, 9)
        assert len(rows._host_arrays) <= rows._HOST_ARRAYS_KEPT
