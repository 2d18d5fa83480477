"""The vLLM op guard on CUDA: sync-free, captured in a CUDA graph, replayed
with different fresh rows. Poisoned caches; only fresh rows' slots may change.

vLLM is not needed: the forward context is a stand-in with the same fields.
"""

from types import SimpleNamespace

import pytest
import torch

vllm_forward_context = pytest.importorskip("vllm.forward_context", reason="needs vLLM's forward context module")

from gdn_pass.metadata import StagedRowMetadata  # noqa: E402
from gdn_pass.vllm.handoff import StepHandoff, attach  # noqa: E402
from gdn_pass.vllm.op_guard import zero_fresh_state  # noqa: E402

LAYER = "model.layers.0.linear_attn"
NUM_SLOTS, MAX_ROWS = 64, 16


def caches():
    conv = torch.randn(NUM_SLOTS, 3, 512, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # dense, permuted
    pool = torch.randn(NUM_SLOTS, 2 * 4 * 32 * 32 + 100, device="cuda")  # slot stride > slot size
    ssm = pool[:, : 4 * 32 * 32].view(NUM_SLOTS, 4, 32, 32)
    return conv, ssm
