"""harness.step_trace: one step's rows by kernel path and kind, from vLLM's fields (no engine).

The paths follow vLLM 0.26-0.30's GDN builder: speculative rows by their mask;
the other rows split by ``split_decodes_and_prefills(m, decode_threshold=1)``,
which counts the leading rows of at most one token as decodes.
"""

from harness.step_trace import row_kinds, row_paths, slot_reading_fresh_rows, spec_prompt_rows


def test_fresh_one_token_row_in_a_step_without_prefill_is_the_trigger():
    paths = row_paths([False] * 3, num_decodes=3)
    kinds = row_kinds(query_lens=[1, 1, 1], num_computed_tokens=[12, 0, 30], paths=paths)
    assert kinds["fresh_decode"] == 1 and kinds["decode"] == 2 and kinds["fresh_prefill"] == 0


def test_fresh_one_token_row_ordered_before_a_prefill_is_a_decode_too():
    # vLLM orders decodes, then short extends (a new one-token prompt), then
    # prefills: the split's boundary is the first row of more than one token
    paths = row_paths([False] * 3, num_decodes=2)
    assert paths == ["decode", "decode", "prefill"]
    kinds = row_kinds(query_lens=[1, 1, 8], num_computed_tokens=[12, 0, 16], paths=paths)
    assert kinds["fresh_decode"] == 1 and kinds["continuation"] == 1 and kinds["decode"] == 1


def test_fresh_row_past_the_split_is_a_fresh_prefill():
    paths = row_paths([False] * 3, num_decodes=1)
    kinds = row_kinds(query_lens=[1, 8, 1], num_computed_tokens=[12, 16, 0], paths=paths)
    assert kinds["fresh_prefill"] == 1 and kinds["fresh_decode"] == 0
    assert kinds["continuation"] == 1 and kinds["decode"] == 1


def test_the_rows_a_guard_acts_on_are_fresh_rows_on_a_slot_reading_path():
    """Per request: nothing computed and tokens to run, on a decode or speculative path (a prefill
    starts from zero itself; padding runs no token). The trace keeps these for every builder of a
    step, an MTP drafter's included."""
    ids = ["q1", "q2", "q3", "q4", "q5", "pad"]
    paths = ["decode", "spec", "decode", "prefill", "prefill", "decode"]
    found = slot_reading_fresh_rows(ids, num_computed_tokens=[0, 0, 7, 0, 9, 0], query_lens=[1, 2, 1, 1, 8, 0],
                                    paths=paths)
    assert found == {"q1": "decode", "q2": "spec"}


def test_speculative_rows_by_mask_and_padding_not_counted():
    # a fresh prompt padded to 1 + k tokens next to speculating decodes is a
    # speculative row that reads its slot; non-speculative one-token rows in
    # such a step are prefills (the builder sets num_decodes to 0)
    paths = row_paths([True, True, False, False, False], num_decodes=0)
    assert paths == ["spec", "spec", "prefill", "prefill", "prefill"]
    kinds = row_kinds(query_lens=[2, 2, 1, 0, 0], num_computed_tokens=[40, 0, 9, 0, 0], paths=paths)
    assert kinds["spec"] == 2 and kinds["fresh_decode"] == 1 and kinds["decode"] == 2
    assert kinds["fresh_prefill"] == 0


def test_lightning_metadata_paths_decodes_first_spec_by_slot_columns():
    # Lightning builders (vLLM linear_attn) put decodes first; with MTP their decode
    # slots have one column per token (1 + k): those rows run the speculative kernel
    from types import SimpleNamespace

    from harness.step_trace import metadata_row_paths

    plain = SimpleNamespace(num_decodes=2, num_prefills=1, state_indices_tensor=torch.tensor([3, 4, 5]))
    assert metadata_row_paths(plain, 3) == ["decode", "decode", "prefill"]
    spec = SimpleNamespace(num_decodes=2, num_prefills=0, state_indices_tensor_d=torch.tensor([[1, 2], [3, 4]]))
    assert metadata_row_paths(spec, 2) == ["spec", "spec"]
    kinds = row_kinds(query_lens=[2, 2], num_computed_tokens=[0, 9], paths=metadata_row_paths(spec, 2))
    assert kinds["fresh_decode"] == 1 and kinds["spec"] == 2
    gdn = SimpleNamespace(num_decodes=1, spec_sequence_masks=None)
    assert metadata_row_paths(gdn, 2) == ["decode", "prefill"]


# --- the plugin hook's count against the trace's (compare_with_hook) ---------------


def _step(host_seq_lens, qlens, device_computed, *, num_decodes, host_fresh, columns=None):
    """One built step as the trace sees it: the scheduler's host lengths (what the hook reads),
    the device's computed counts (what the trace reads) and the hook's hand-off."""
    from types import SimpleNamespace

    import torch as t

    from gdn_pass.vllm.handoff import StepHandoff

    m = SimpleNamespace(num_reqs=len(qlens), seq_lens_cpu_upper_bound=t.tensor(host_seq_lens, dtype=t.int32))
    md = SimpleNamespace(num_decodes=num_decodes, num_prefills=len(qlens) - num_decodes,
                         state_indices_tensor_d=None if columns is None else t.zeros(num_decodes, columns),
                         gdn_pass_handoff=StepHandoff(rows=None, host_fresh=host_fresh))
    return m, md, t.tensor(qlens, dtype=t.int32), t.tensor(device_computed, dtype=t.int32)


def test_prompt_rows_on_the_speculative_path_are_those_without_drafts_and_of_several_tokens():
    ids = ["a", "b", "c", "d", "e"]
    paths = ["spec", "spec", "spec", "spec", "prefill"]
    # a: speculating (1 draft); b: a prompt's last chunk; c: one prompt token; d: padding; e: prefill
    found = spec_prompt_rows(ids, [2, 2, 1, 0, 8], paths, [1, -1, -1, -1, -1])
    assert found == {"b": "spec"}
    # no draft counts from the runner: no row of the step has drafts
    assert spec_prompt_rows(ids, [2, 2, 1, 0, 8], paths, None) == {"a": "spec", "b": "spec"}


def test_hook_and_trace_agreeing_is_counted_and_keeps_no_rows():
    state = {}
    m, md, qlens, computed = _step([12, 1, 31], [1, 1, 1], [11, 0, 30], num_decodes=3, host_fresh=2, columns=2)
    step_trace.compare_with_hook(state, m, md, ["a", "b", "c"], qlens, computed, trace_fresh=1)
    assert state["hook_compared"] == 1 and state["hook_disagreements"] == []


def test_a_deferred_build_is_counted_and_its_rows_are_not_made():
    """A deferred build's rows are the step's first guarded op's to make: the trace must not make
    them at build (it would run the path the engine skips) and compares nothing for it."""
    import pytest

    from gdn_pass.vllm.handoff import StepHandoff

    state = {}
    m, md, qlens, computed = _step([12, 1, 31], [1, 1, 1], [11, 0, 30], num_decodes=3, host_fresh=1)
    md.gdn_pass_handoff = StepHandoff(rows=None, resolve=lambda *a: pytest.fail("the deferred build resolved"))
    step_trace.compare_with_hook(state, m, md, ["a", "b", "c"], qlens, computed, trace_fresh=1)
    assert state == {"hook_deferred": 1}


def test_a_row_the_hook_counts_and_the_trace_does_not_is_kept_with_both_views():
    # the hook's host lengths call row "b" new; the device's computed count says it has a token
    state = {"steps": [{}]}
    m, md, qlens, computed = _step([12, 1, 31], [1, 1, 1], [11, 1, 30], num_decodes=3, host_fresh=1)
    step_trace.compare_with_hook(state, m, md, ["a", "b", "c"], qlens, computed, trace_fresh=0)
    [kept] = state["hook_disagreements"]
    assert (kept["hook_fresh"], kept["trace_fresh"], kept["req_ids"]) == (1, 0, ["a", "b", "c"])
    assert kept["computed_host"] == [11, 0, 30] and kept["computed_device"] == [11, 1, 30]


def test_steps_without_a_hand_off_are_not_compared():
    from types import SimpleNamespace

    state = {}
    step_trace.compare_with_hook(state, None, SimpleNamespace(), [], None, None, trace_fresh=1)
    assert state == {}


# --- deliberate breaks for diagnostic fuzz runs (GDN_FUZZ_MUTATION) ----------------

import pytest  # noqa: E402
import torch  # noqa: E402

from harness import step_trace  # noqa: E402
from gdn_pass.vllm import handoff  # noqa: E402


@pytest.fixture
def guard_functions(monkeypatch):
    """The zeroing kernels both guards launch (through ``StepHandoff.zero``), restored after the test."""
    for name in ("zero_rows", "zero_rows_all", "zero_new_rows_all"):
        monkeypatch.setattr(handoff, name, getattr(handoff, name))


def _fresh_slot_cache():
    cache = torch.ones(4, 3)
    slot, fresh = torch.tensor([2, 0]), torch.tensor([True, False])
    return cache, slot, fresh


def test_unmutated_guard_zeroes_the_fresh_slot(guard_functions):
    step_trace.apply_mutation(None)
    cache, slot, fresh = _fresh_slot_cache()
    handoff.zero_rows(cache, slot, fresh)
    assert cache[2].eq(0).all() and cache[[0, 1, 3]].eq(1).all()


@pytest.mark.parametrize("mutation", ["skip_zeroing", "zeroing_without_writes"])
def test_mutations_leave_the_fresh_slot_as_it_was(guard_functions, mutation):
    step_trace.apply_mutation(mutation)
    cache, slot, fresh = _fresh_slot_cache()
    handoff.zero_rows(cache, slot, fresh)
    assert cache.eq(1).all(), mutation


def test_zeroing_without_writes_still_calls_the_zeroing_with_no_row_fresh(guard_functions, monkeypatch):
    seen = []
    monkeypatch.setattr(handoff, "zero_rows_all", lambda table, slot, fresh: seen.append(fresh.clone()))
    step_trace.apply_mutation("zeroing_without_writes")
    handoff.zero_rows_all("table", torch.tensor([2, 0]), torch.tensor([True, True]))
    assert len(seen) == 1 and not seen[0].any()


def test_mutations_reach_the_cuda_path_that_finds_fresh_rows_on_the_device(guard_functions, monkeypatch):
    guard = handoff
    # Both guards' CUDA path (the op guard's steps without speculative rows, the step guard's
    # Lightning and eager GDN steps) launches zero_new_rows_all, which finds fresh rows itself
    # (query_len == seq_len): skip_zeroing must skip it, and zeroing_without_writes must launch
    # it with no row able to qualify
    seen = []
    monkeypatch.setattr(guard, "zero_new_rows_all", lambda table, slot, qsl, seq_lens, n, m: seen.append(seq_lens))
    step_trace.apply_mutation("zeroing_without_writes")
    query_start_loc, seq_lens = torch.tensor([0, 1, 2]), torch.tensor([1, 9])  # row 0 fresh
    guard.zero_new_rows_all("table", torch.tensor([3, 4]), query_start_loc, seq_lens, 2, 2)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    assert len(seen) == 1 and not (query_lens == seen[0]).any()
    step_trace.apply_mutation("skip_zeroing")
    guard.zero_new_rows_all("table", torch.tensor([3, 4]), query_start_loc, seq_lens, 2, 2)
    assert len(seen) == 1


def test_unknown_mutation_is_refused_by_name():
    with pytest.raises(ValueError, match="known mutations are"):
        step_trace.apply_mutation("zero_everything")


def test_a_speculative_steps_slot_columns_and_accepted_counts_are_kept_in_the_detail():
    import types

    import torch

    from harness.step_trace import _spec_detail

    md = types.SimpleNamespace(state_indices_tensor_d=torch.tensor([[1, 2], [4, 5]]),
                               num_accepted_tokens=torch.tensor([1, 2]))
    assert _spec_detail(md) == dict(slots_d=[[1, 2], [4, 5]], num_accepted=[1, 2])
    # GDN's metadata and non-speculative Lightning steps have neither field
    assert _spec_detail(types.SimpleNamespace(num_accepted_tokens=None)) == {}
