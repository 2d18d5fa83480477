"""gdn_pass.examples.step_trace: one step's rows by kernel path and kind, from vLLM's fields (no engine).

The paths follow vLLM 0.26-0.30's GDN builder: speculative rows by their mask;
the other rows split by ``split_decodes_and_prefills(m, decode_threshold=1)``,
which counts the leading rows of at most one token as decodes.
"""

from gdn_pass.examples.step_trace import row_kinds, row_paths


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


def test_speculative_rows_by_mask_and_padding_not_counted():
    # a fresh prompt padded to 1 + k tokens next to speculating decodes is a
    # speculative row that reads its slot; non-speculative one-token rows in
    # such a step are prefills (the builder sets num_decodes to 0)
    paths = row_paths([True, True, False, False, False], num_decodes=0)
    assert paths == ["spec", "spec", "prefill", "prefill", "prefill"]
    kinds = row_kinds(query_lens=[2, 2, 1, 0, 0], num_computed_tokens=[40, 0, 9, 0, 0], paths=paths)
    assert kinds["spec"] == 2 and kinds["fresh_decode"] == 1 and kinds["decode"] == 2
    assert kinds["fresh_prefill"] == 0
