"""The op guard's zeroing on CUDA: sync-free, captured once in a CUDA
graph, replayed with different fresh rows restaged in place. Caches are
random "previous owners' state"; only the fresh rows' slots may change.
"""

import random

import torch

from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.kernels.zero_rows import zero_rows

NUM_SLOTS, MAX_ROWS = 64, 16


def vllm_like_caches():
    # conv: a dense but permuted slot (vLLM's transposed conv view);
    # ssm: slots inside a larger page, stride(0) > slot size (shared page pool).
    conv = torch.randn(NUM_SLOTS, 3, 512, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    pool = torch.randn(NUM_SLOTS, 4 * 32 * 32 + 100, device="cuda")
    ssm = pool[:, : 4 * 32 * 32].view(NUM_SLOTS, 4, 32, 32)
    return conv, ssm, pool


def test_captured_zeroing_touches_only_fresh_slots():
    conv, ssm, pool = vllm_like_caches()
    rows = StagedRowMetadata(MAX_ROWS, device="cuda", pad_slot_ids=(-1, 0))
    rows.stage(num_computed_tokens=torch.zeros(1, dtype=torch.int64), query_lens=torch.zeros(1, dtype=torch.int64),
               state_slots=torch.full((1,), -1))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for cache in (conv, ssm):  # compile the kernel outside capture
            zero_rows(cache, rows.state_slot, rows.fresh_rows())
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fresh = rows.fresh_rows()
        for cache in (conv, ssm):
            zero_rows(cache, rows.state_slot, fresh)

    rng = random.Random(0)
    for step in range(30):
        n = rng.randint(1, MAX_ROWS)
        slots = rng.sample(range(1, NUM_SLOTS), n)
        computed = [0 if rng.random() < 0.5 else rng.randint(1, 9) for _ in range(n)]
        qlens = [1 if rng.random() < 0.8 else 0 for _ in range(n)]  # some padding rows
        for i in range(n):
            if rng.random() < 0.1:
                slots[i] = rng.choice([-1, 0])  # sentinel padding
        for t in (conv, pool):
            t.copy_(torch.randn_like(t) if t.dtype == torch.float32 else torch.randn_like(t.float()).to(t.dtype))
        before = (conv.clone(), pool.clone())
        rows.stage(num_computed_tokens=torch.tensor(computed), query_lens=torch.tensor(qlens),
                   state_slots=torch.tensor(slots))
        graph.replay()
        torch.cuda.synchronize()
        fresh = {s for s, c, q in zip(slots, computed, qlens) if c == 0 and q > 0 and s > 0}
        for s in range(NUM_SLOTS):
            if s in fresh:
                assert conv[s].eq(0).all() and ssm[s].eq(0).all(), (step, s)
                assert torch.equal(pool[s, 4 * 32 * 32:], before[1][s, 4 * 32 * 32:]), "wrote past the slot"
            else:
                assert torch.equal(conv[s], before[0][s]) and torch.equal(pool[s], before[1][s]), (step, s)
