"""gdn_pass.examples.step_trace.row_kinds: one step's rows by kind, from vLLM's fields (no engine)."""

from gdn_pass.examples.step_trace import row_kinds


def test_fresh_one_token_row_in_a_step_without_prefill_is_the_trigger():
    kinds = row_kinds(query_lens=[1, 1, 1], num_computed_tokens=[12, 0, 30], num_decodes=3,
                      num_prefills=0, num_spec_decodes=0)
    assert kinds["fresh_decode"] == 1 and kinds["decode"] == 2 and kinds["fresh_prefill"] == 0


def test_fresh_row_next_to_a_prefill_is_a_fresh_prefill():
    kinds = row_kinds(query_lens=[1, 8, 1], num_computed_tokens=[12, 16, 0], num_decodes=1,
                      num_prefills=2, num_spec_decodes=0)
    assert kinds["fresh_prefill"] == 1 and kinds["fresh_decode"] == 0
    assert kinds["continuation"] == 1 and kinds["decode"] == 1


def test_padding_rows_are_not_counted_and_spec_rows_are():
    kinds = row_kinds(query_lens=[2, 2, 0, 0], num_computed_tokens=[40, 0, 0, 0], num_decodes=2,
                      num_prefills=0, num_spec_decodes=2)
    assert kinds["spec"] == 2 and kinds["fresh_decode"] == 1 and kinds["decode"] == 1
    assert sum(v for k, v in kinds.items() if k != "spec") == 2
