"""benchmarks/hook_in_engine.py: the 'answered' state is the shipped hook with only its step check
answered, and a window whose steps the check could not prove free of new rows is caught."""

from benchmarks.hook_in_engine import StepCheck
from gdn_pass.vllm import metadata_hook, rows


def test_answered_and_kept_replace_only_the_step_check_and_on_puts_the_real_one_back(monkeypatch):
    monkeypatch.setattr(metadata_hook, "has_new_rows", metadata_hook.has_new_rows)
    real = metadata_hook.has_new_rows
    check = StepCheck()
    check.set("answered")
    assert metadata_hook.has_new_rows is not real
    assert metadata_hook.has_new_rows(object()) is False
    check.set("kept")
    common = object()
    assert metadata_hook.has_new_rows(common) is False
    assert check.kept == [common]  # alive until the case ends
    check.set("on")
    assert metadata_hook.has_new_rows is real


def test_a_window_with_a_step_whose_rows_were_computed_is_counted(monkeypatch):
    monkeypatch.setattr(rows, "_last_step", [None])
    check = StepCheck()
    assert check.window(lambda: 1.0) == 1.0
    assert check.windows_with_rows == 0
    # What rows.scheduler_rows does on a step with a new row (or one the check cannot rule out).
    check.window(lambda: rows._last_step.__setitem__(0, object()))
    assert check.windows_with_rows == 1
    check.window(lambda: None)  # the same rows kept: nothing computed in this window
    assert check.windows_with_rows == 1
