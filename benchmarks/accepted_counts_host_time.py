"""Host time of passing the V2 runner's accepted counts to a Lightning builder (``gdn_pass.vllm.accepted_counts``).

This process's vLLM's own ``MambaHybridAttnMetadata`` (the V2 runner's
per-step speculative metadata) and a real ``BailingLinearAttentionMetadataBuilder``
made for one speculative token. Per step of B rows, medians over blocks in one run:

    vllm_us      the runner's method as vLLM ships it, for the Lightning builder (returns {})
    wrapped_us   the same call through gdn-pass's wrapper (returns the counts)
    prepare_us   the wrapper's work in ``prepare_attn``: each row's drafts by V1's rule
                 (``padded_draft_counts``), once per step

Steps: ``speculating B`` (B rows past their prompt, each a token and its draft:
an MTP engine's common step) and ``padded B`` (the same, one row a new
request padded with a placeholder draft).

A step costs the host ``prepare_us`` once plus ``wrapped_us - vllm_us`` per
Lightning group (the runner calls the method once per group and step).

    python benchmarks/accepted_counts_host_time.py [--batches 1 8 64 256] [--repeat 2000] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 1  # speculative tokens


def runner_classes():
    from gdn_pass.vllm import accepted_counts

    return [getattr(importlib.import_module(module), name)
            for module, name in (accepted_counts.RUNNER_METADATA, accepted_counts.RUNNER_STATE)]


def per_call_us(fn, repeat: int, blocks: int) -> float:
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - start) / repeat * 1e6)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()

    import vllm
    from vllm.config import VllmConfig

    from gdn_pass.vllm import accepted_counts, support
    from tests.vllm.test_linear_attention_builders import new_linear_builder, poisoned_caches
    from tests.vllm.test_metadata_hook import vllm_config

    VllmConfig.num_speculative_tokens = property(lambda self: K)
    support.runs_v2_model_runner = lambda vllm_config: True
    metadata_cls, state_cls = runner_classes()
    original = metadata_cls.get_extra_attn_kwargs
    config = vllm_config(configured=True)
    poisoned_caches(config)
    builder = new_linear_builder(config, spec_tokens=K)  # supplies the counts (wraps the runner)
    assert accepted_counts.supplies(builder)
    wrapped = metadata_cls.get_extra_attn_kwargs
    rows = []
    for kind in ("speculating", "padded"):
        for b in args.batches:
            prefilling = np.zeros(b, dtype=bool)
            drafts = torch.full((b,), K, dtype=torch.int32)
            if kind == "padded":
                prefilling[-1], drafts[-1] = True, -1  # the V2 runner's -1 for a prompt row
            metadata = metadata_cls(is_prefilling=torch.from_numpy(prefilling),
                                    num_accepted_tokens=torch.ones(b, dtype=torch.int32),
                                    num_decode_draft_tokens_cpu=drafts)
            batch = SimpleNamespace(num_draft_tokens_per_req=np.full(b, K, dtype=np.int32),
                                    num_scheduled_tokens=np.full(b, 1 + K, dtype=np.int32),
                                    is_prefilling_np=prefilling)
            accepted_counts._Step.padded_drafts = accepted_counts.padded_draft_counts(batch)
            got = wrapped(metadata, builder, b)["num_decode_draft_tokens_cpu"]
            assert got.tolist() == [K] * b, got  # the padded row counts its placeholder
            row = dict(step=kind, rows=b,
                       vllm_us=per_call_us(lambda: original(metadata, builder, b), args.repeat, args.blocks),
                       wrapped_us=per_call_us(lambda: wrapped(metadata, builder, b), args.repeat, args.blocks),
                       prepare_us=per_call_us(lambda: accepted_counts.padded_draft_counts(batch),
                                              args.repeat, args.blocks))
            accepted_counts._Step.padded_drafts = None
            row["step_us"] = row["prepare_us"] + row["wrapped_us"] - row["vllm_us"]
            rows.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    result = dict(vllm=vllm.__version__, torch=torch.__version__, host=platform.machine(),
                  command=" ".join(sys.argv), repeat=args.repeat, blocks=args.blocks, rows=rows)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "accepted_counts_host_time.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
