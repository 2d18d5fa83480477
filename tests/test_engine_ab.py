"""benchmarks/engine_ab.py: the confidence interval it reports for the median on/off ratio."""

import random

import pytest

from benchmarks.engine_ab import median_interval


# Ranks (1-based) of the distribution-free 95% interval of the median, from the sign test's
# binomial tables (for example Conover, Practical Nonparametric Statistics, table A3).
@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (40, (14, 27)), (100, (40, 61))])
def test_the_interval_is_the_sign_tests(n, ranks):
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)
    assert median_interval(values) == ranks


def test_the_interval_covers_the_median_about_95_times_in_100():
    rng = random.Random(0)
    covered = sum(low <= 0.0 <= high for low, high in
                  (median_interval([rng.gauss(0.0, 1.0) for _ in range(40)]) for _ in range(2000)))
    assert 0.93 <= covered / 2000 <= 0.98


class _Engine:
    """What ``case`` asks of vLLM's engine: each step gives every running decoder one token."""

    def __init__(self):
        self.left: dict[str, int] = {}  # decoder -> tokens it may still produce
        self.added: list[str] = []

    def add_request(self, rid, prompt, params):
        if rid.startswith("d"):
            self.left[rid] = params.max_tokens
            self.added.append(rid)

    def step(self):
        for rid in self.left:
            self.left[rid] -= 1
            assert self.left[rid] >= 0, f"{rid} ran out of tokens"

    def abort_request(self, ids):
        for rid in ids:
            del self.left[rid]

    def has_unfinished_requests(self):
        return False


def _case_with_noise(monkeypatch, noise: float, **kwargs) -> tuple[dict, _Engine]:
    """``engine_ab.case`` over windows whose on/off ratio is 1.01 with ``noise`` (relative,
    Gaussian); each window steps the fake engine as many times as it has steps."""
    from types import SimpleNamespace

    from benchmarks import engine_ab

    rng = random.Random(1)
    state = {"on": True}

    def window(engine, _rng, fresh, steps, clock):
        for _ in range(steps):
            engine.step()
        wall = 1e-3 * (1.01 if state["on"] else 1.0) * (1 + rng.gauss(0.0, noise))
        return wall, wall, 1e-5, 0.0

    switch = SimpleNamespace(set=lambda on: state.update(on=on), clock=None)
    monkeypatch.setattr(engine_ab, "window", window)
    engine = _Engine()
    result = engine_ab.case(SimpleNamespace(llm_engine=engine), switch, batch=8, fresh=0, window_steps=10,
                            warmup=10, **kwargs)
    return result, engine


def test_more_pairs_until_the_interval_of_the_median_is_as_narrow_as_asked(monkeypatch):
    """With a target the case adds pairs until the 95% interval of the median ratio is that narrow
    (relative to the ratio), within the time it was given; its median is then near the true
    ratio (1.01 here)."""
    result, _ = _case_with_noise(monkeypatch, 0.02, pairs=20, max_tokens=100_000, ci_target=0.005, max_pairs=5000)
    plain, _ = _case_with_noise(monkeypatch, 0.02, pairs=20, max_tokens=100_000)
    assert result["ci_width"] <= 0.005 < plain["ci_width"]
    assert abs(result["ratio"] - 1.01) <= 0.005 and 20 < result["pairs"] < 5000
    timed_out, _ = _case_with_noise(monkeypatch, 0.02, pairs=20, max_tokens=100_000, ci_target=0.005,
                                    max_pairs=5000, case_seconds=0.0)
    assert timed_out["pairs"] == 20  # out of time: the pairs asked for, no more


def test_without_a_target_the_pairs_asked_run(monkeypatch):
    assert _case_with_noise(monkeypatch, 0.02, pairs=20, max_tokens=100_000)[0]["pairs"] == 20
    assert _case_with_noise(monkeypatch, 0.02, pairs=20, max_tokens=100_000, ci_target=0.5)[0]["pairs"] == 20
    # the command line always passes --max-pairs (default 2000): without --ci-target it is no target
    assert _case_with_noise(monkeypatch, 0.02, pairs=20, max_tokens=100_000, max_pairs=2000)[0]["pairs"] == 20


def test_decoders_are_replaced_before_they_run_out_of_tokens(monkeypatch):
    """Each pair's two windows take 20 tokens of every decoder, and none may finish inside a
    window (the batch would shrink; the fake engine asserts it). With 100 tokens each (4 go to
    the prefill steps, 10 to the warm-up), a set of decoders serves 3 pairs: 30 pairs take 10 sets
    of 8, replaced between pairs."""
    result, engine = _case_with_noise(monkeypatch, 0.02, pairs=30, max_tokens=100)
    assert result["pairs"] == 30 and len(engine.added) == 10 * 8 and not engine.left  # the last 8 aborted at the end
