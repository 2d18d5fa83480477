"""harness/fla_autotune.py's kernel finding, and benchmarks/fla_autotune_bits.py's pinning and
comparison, on a toy autotuned kernel (CPU).

The toy sums each row in blocks of ``BK`` (the block size sets the order of the
float additions), autotuned over ``BK`` and the warps (which the interpreter
ignores), under a heuristic as vLLM's ``chunk_delta_h`` kernel is. It runs in
Triton's interpreter, in a subprocess started with ``TRITON_INTERPRET=1``
(``tests/triton_interpreter.py``). The reference for each configuration is a
launch of the same kernel without the tuner, with that configuration's
``BK``: the comparison must report what those launches give.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fla_autotune_bits import config_bits, pinned  # noqa: E402

from harness.fla_autotune import autotuned_kernels, find_autotuner  # noqa: E402

from tests.triton_interpreter import run_in_interpreter  # noqa: E402

BLOCKS = (16, 32, 64)


def _toy_kernels():
    import triton
    import triton.language as tl

    def rowsum(x, y, K: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros([BK], dtype=tl.float32)
        for start in range(0, K, BK):
            acc += tl.load(x + row * K + start + tl.arange(0, BK))
        tl.store(y + row, tl.sum(acc) * SCALE)

    plain = triton.jit(rowsum)
    configs = [triton.Config({"BK": bk}, num_warps=w) for bk in BLOCKS for w in (1, 4)]
    tuned = triton.heuristics({"SCALE": lambda args: 1})(
        triton.autotune(configs=configs, key=["K"])(triton.jit(rowsum)))
    return plain, tuned


def interpreted_cases() -> dict:
    """Run with the interpreter on: the direct launches, the comparison's report, the tuner after it."""
    import types

    plain, tuned = _toy_kernels()
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(0)) * 1e3

    def launch(kernel, **meta):
        y = torch.empty(32)
        kernel[(32,)](x, y, K=256, **meta)
        return y

    direct = {bk: launch(plain, BK=bk, SCALE=1) for bk in BLOCKS}
    tuner = find_autotuner(tuned)
    before = list(tuner.configs)
    report = config_bits(lambda: (launch(tuned),), {"rowsum": tuner})
    cut = config_bits(lambda: (launch(tuned),), {"rowsum": tuner}, limit_s=0)
    restored = tuner.configs == before and tuner.cache == {}

    tuner.cache[(256,)] = before[3]
    with pinned({"t": tuner}, {"t": 4}):
        inside = tuner.configs == [before[4]] and tuner.cache == {}
    pin_restored = tuner.configs == before and tuner.cache == {(256,): before[3]}

    module = types.ModuleType("ops.toy")
    module.rowsum, module.alias, module.other = tuned, tuned, 3  # alias: the same kernel twice
    found = list(autotuned_kernels([module]))
    return dict(
        report=report, cut_rows=len(cut["rows"]), cut_complete=cut["complete"], restored=restored, inside=inside, pin_restored=pin_restored, found=found,
        configs=[(c.kwargs["BK"], c.num_warps, c.num_stages) for c in before],
        differing={bk: int((direct[bk] != direct[16]).sum()) for bk in BLOCKS},
        largest={bk: float((direct[bk] - direct[16]).abs().max()) for bk in BLOCKS})


@pytest.fixture(scope="module")
def cases():
    return run_in_interpreter(__file__, timeout=300)


def test_each_configuration_reports_what_a_direct_launch_with_it_gives(cases):
    differing = {int(bk): n for bk, n in cases["differing"].items()}
    largest = {int(bk): d for bk, d in cases["largest"].items()}
    assert differing[64] > 0  # the toy does sum differently per block size
    rows = cases["report"]["rows"]
    assert [row["config"] for row in rows] == [f"BK={bk} w{w} s{s}" for bk, w, s in cases["configs"]]
    for row, (bk, _, _) in zip(rows, cases["configs"]):
        assert row["differing"] == [differing[bk]] and row["same"] == (differing[bk] == 0)
        assert row["largest"] == [largest[bk]]
    kernel = cases["report"]["kernels"]["rowsum"]
    assert kernel["configs"] == 6 and kernel["differ"] == sum(differing[bk] > 0 for bk, _, _ in cases["configs"])
    assert cases["restored"]
    assert cases["report"]["complete"]
    # with no time left only the first configuration (the baseline) is reported, and it says so
    assert cases["cut_rows"] == 1 and cases["cut_complete"] is False


def test_pinning_runs_the_chosen_configuration_and_restores_the_tuner(cases):
    assert cases["inside"] and cases["pin_restored"]


def test_autotuned_kernels_are_found_once_under_their_wrappers(cases):
    assert cases["found"] == ["toy.rowsum"]


if __name__ == "__main__":
    print(json.dumps(interpreted_cases()))
