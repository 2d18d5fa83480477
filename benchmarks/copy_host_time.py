"""Host time of the copies the metadata hook enqueues on a step with a row to zero, idle GPU vs busy GPU.

Each copy is timed on the host (median of 30) with the stream idle and with
2 ms of GPU work queued in front of it (``torch.cuda._sleep``, calibrated
with CUDA events): a copy that waited for the stream would take ~2000 us.

    pageable H2D       256 bool flags from a fresh numpy array (what ``stage_fresh`` does)
    pinned H2D         the same from a pinned tensor
    D2D int32->int64   64 slots into the staged int64 buffer (a converting copy kernel)

    python benchmarks/copy_host_time.py
"""

import time

import numpy as np
import torch


def main() -> None:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles_2ms = int(10_000_000 * 2.0 / start.elapsed_time(end))
    flags = torch.zeros(256, dtype=torch.bool, device="cuda")
    pinned = torch.zeros(256, dtype=torch.bool, pin_memory=True)
    slots = torch.arange(256, dtype=torch.int32, device="cuda")
    staged = torch.zeros(256, dtype=torch.int64, device="cuda")
    copies = {
        "pageable H2D": lambda: flags.copy_(torch.from_numpy(np.zeros(256, dtype=bool)), non_blocking=True),
        "pinned H2D": lambda: flags.copy_(pinned, non_blocking=True),
        "D2D int32->int64": lambda: staged[:64].copy_(slots[:64], non_blocking=True),
    }
    for label, copy in copies.items():
        for busy in (False, True):
            times = []
            for _ in range(30):
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(cycles_2ms)
                t = time.perf_counter()
                copy()
                times.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize()
            print(f"{label:18s} behind 2 ms of GPU work={busy}: median {sorted(times)[15]:.1f} us, "
                  f"max {max(times):.1f} us")


if __name__ == "__main__":
    main()
