"""``StagedRowMetadata.stage`` on CUDA takes the fused launch and stages what a naive reference says.

Host-side counts and device slots, as vLLM's builder hands them over. Each
step is staged by a CUDA ``StagedRowMetadata`` (the fused path, checked to be
taken) and compared with the per-row reference of ``tests/kernels/test_stage.py``
and with a CPU ``StagedRowMetadata`` (the PyTorch path) of the same step.
"""

import random

import pytest
import torch

from gdn_pass.kernels import stage
from gdn_pass.metadata import StagedRowMetadata
from tests.kernels.test_stage import PADS, naive_stage, random_batch

FIELDS = ("has_initial_state", "valid", "reads_state", "fresh", "state_slot")


def staged(rows):
    return list(zip(*(getattr(rows, k).tolist() for k in FIELDS)))


@pytest.mark.parametrize("max_rows", [16, 256, 1100])
def test_fused_stage_on_cuda(monkeypatch, max_rows):
    launches = []
    fused = stage.stage_rows_fused
    monkeypatch.setattr(stage, "stage_rows_fused", lambda **kw: launches.append(1) or fused(**kw))
    on_cuda = StagedRowMetadata(max_rows, device="cuda", pad_slot_ids=PADS)
    on_cpu = StagedRowMetadata(max_rows, device="cpu", pad_slot_ids=PADS)
    rng = random.Random(max_rows)
    # Shrinking and growing batches: rows a larger earlier step staged must become padding.
    for n in [max_rows, 3, 0, max_rows // 2, 1, max_rows]:
        query_lens, computed, slots, zero_start_rows = random_batch(rng, n)
        inputs = dict(num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
                      query_lens=torch.tensor(query_lens, dtype=torch.int32), zero_start_rows=zero_start_rows)
        on_cuda.stage(state_slots=torch.tensor(slots, dtype=torch.int32, device="cuda"), **inputs)
        on_cpu.stage(state_slots=torch.tensor(slots, dtype=torch.int32), **inputs)
        expected = naive_stage(query_lens, computed, slots, zero_start_rows, max_rows, PADS)
        assert staged(on_cuda) == expected
        assert staged(on_cpu) == expected
    assert len(launches) == 6
