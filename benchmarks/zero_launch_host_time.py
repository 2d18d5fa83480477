"""Host time of one zeroing launch on CUDA: what a step with fresh rows adds to the host thread.

Where the step guard owns a group (the Lightning builders, eager GDN engines)
it launches the group zeroing at metadata build, on the host thread that
enqueues the step. This times that call on the host (median, p10, p90 of 300
calls after 20 warm-ups; the GPU work is not waited for), next to a plain
torch op on the same machine. Three caches of ``[64, 16, 128, 128]`` float32
(one 1 MiB slot each, a Lightning group of three layers at 16 heads x 128),
8 decode rows, one of them fresh:

    torch add_                 a plain torch op's launch, for scale
    zero_new_rows_all 1-D      the fresh rows found in vLLM-like device tensors
    zero_new_rows_all [rows,2] the same with two slot columns (MTP, 1 + k = 2)
    zero_rows_all              the staged rows' launch
    kernel[grid](...)          the same kernel through Triton's binder on every launch
                               (gdn-pass's launches go through it only the first time
                               per layout, ``fast_launch``)

    python benchmarks/zero_launch_host_time.py
"""

import statistics
import time

import torch

from gdn_pass.kernels import zero_rows
from gdn_pass.kernels.zero_rows import CacheTable, zero_new_rows_all, zero_rows_all


def timed(name, fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    ts.sort()
    print(f"{name}: median {statistics.median(ts):.1f} us, p10 {ts[n // 10]:.1f}, p90 {ts[9 * n // 10]:.1f}")


def main() -> None:
    dev = torch.device("cuda")
    caches = [torch.randn(64, 16, 128, 128, device=dev) for _ in range(3)]
    table = CacheTable.build(caches)
    slots = torch.arange(64, dtype=torch.int32, device=dev)
    qsl = torch.arange(65, dtype=torch.int32, device=dev)
    seq = torch.full((64,), 7, dtype=torch.int32, device=dev)
    seq[0] = 1  # row 0: all its tokens new
    fresh = torch.zeros(256, dtype=torch.bool, device=dev)
    fresh[0] = True
    slot256 = torch.zeros(256, dtype=torch.int64, device=dev)
    x = torch.zeros(8, device=dev)

    timed("torch add_ (reference launch)", lambda: x.add_(1))
    timed("zero_new_rows_all 1-D, 1 of 8 rows fresh", lambda: zero_new_rows_all(table, slots, qsl, seq, 8, 256))
    timed("zero_new_rows_all [rows, 2]", lambda: zero_new_rows_all(table, slots.view(32, 2), qsl, seq, 8, 512))
    timed("zero_rows_all (staged)", lambda: zero_rows_all(table, slot256, fresh))
    launcher = zero_rows._new_rows_kernel
    grid = (zero_rows._programs(dev),)
    chunks = -(-table.max_slot_words // zero_rows._CHUNK_WORDS)
    timed("Triton's kernel[grid](...) (every launch through Triton's binder)",
          lambda: launcher.kernel[grid](table.table, slots, 1, 0, 1, qsl, seq, 8, 3, chunks, zero_rows._CHUNK_WORDS,
                                        ROWS=256, BLOCK=1024))
    print(f"zero_new_rows_all launches: {launcher.fast_launches} through the C launcher, "
          f"{launcher.triton_launches} through Triton's binder")


if __name__ == "__main__":
    main()
