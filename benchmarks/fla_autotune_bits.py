"""Do the autotuned configurations of vLLM's GDN prefill kernels compute the same bits?

vLLM (0.26 on the H200) runs GatedDeltaNet prefills through flash-linear-
attention's chunk kernels (``vllm/third_party/flash_linear_attention/ops``).
Several are ``@triton.autotune``'d: an engine times their configurations once,
on a 64-token warm-up pass during start-up, and keeps the fastest for every
later prefill (the tuning keys hold head counts and dims, not the length).
Engines that start together on one GPU time them under one another's load, so
two engines can keep different configurations. Where two configurations of one
kernel sum in a different order (block sizes over K or V), their outputs can
differ in the last bits: an engine-wide difference that bf16 rounding hides in
most requests and lets through in a few. The scheduling fuzz saw such a split
(``benchmarks/results/fuzz_engine_drift_gpu.md``); this measures whether the
kernels can cause it.

Each autotuned kernel is pinned to each of its configurations in turn (every
other one at its first), one prefill runs on seeded inputs, and its outputs
(the chunk output and the final state) are compared bit for bit with those of
every kernel at its first configuration:

    python benchmarks/fla_autotune_bits.py [--lengths 192 17] [--heads 2] [--dim 64]
        [--kernels chunk_o chunk_delta_h] [--limit-s 150] [--out DIR]

The defaults are the preemption fuzz's small-state checkpoint (2 value heads of
64, one key head repeated) and a step the fuzz saw move (192 + 17 tokens);
``--kernels`` keeps the kernels whose names contain one of the words
(found by ``harness/fla_autotune.py``). Needs CUDA and vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.fla_autotune import FLA_OPS, vllm_fla_kernels  # noqa: E402


def describe(config) -> str:
    """A configuration as its block sizes, warps and stages: ``BK=32 BV=64 w4 s2``."""
    sizes = " ".join(f"{k}={v}" for k, v in sorted(config.kwargs.items()))
    return f"{sizes} w{config.num_warps} s{config.num_stages}".strip()


@contextlib.contextmanager
def pinned(tuners: dict[str, object], choice: dict[str, int]) -> Iterator[None]:
    """Every tuner runs one configuration: ``choice[name]`` (default its first); the timing is
    skipped (an ``Autotuner`` with one configuration launches it), and the tuners' own
    configurations and caches come back afterwards."""
    saved = {name: (tuner.configs, dict(tuner.cache)) for name, tuner in tuners.items()}
    try:
        for name, tuner in tuners.items():
            tuner.configs = [tuner.configs[choice.get(name, 0)]]
            tuner.cache.clear()
        yield
    finally:
        for name, tuner in tuners.items():
            tuner.configs, cache = saved[name]
            tuner.cache.clear()
            tuner.cache.update(cache)


def config_bits(run: Callable[[], tuple[torch.Tensor, ...]], tuners: dict[str, object],
                limit_s: float | None = None) -> dict:
    """Run ``run`` with every tuner at its first configuration, then each tuner at each of its
    others; per configuration, whether each output equals the first's bit for bit and by how much
    it differs. ``run`` returns the outputs to compare (a tuple of tensors). After ``limit_s``
    seconds no further configuration is tried (each is a compile): ``complete`` says whether all were."""
    deadline = None if limit_s is None else time.monotonic() + limit_s
    with pinned(tuners, {}):
        base = [t.detach().clone() for t in run()]
    rows, complete = [], True
    for name, tuner in tuners.items():
        for index, config in enumerate(tuner.configs):
            if index and deadline is not None and time.monotonic() > deadline:
                complete = False
                break
            row = dict(kernel=name, index=index, config=describe(config))
            if index == 0:
                row.update(same=True, differing=[0] * len(base), largest=[0.0] * len(base))
            else:
                with pinned(tuners, {name: index}):
                    outs = run()
                differing = [int((a != b).sum()) for a, b in zip(base, outs)]
                row.update(same=not any(differing), differing=differing,
                           largest=[float((a.float() - b.float()).abs().max()) for a, b in zip(base, outs)])
            rows.append(row)
    kernels = {}
    for row in rows:
        k = kernels.setdefault(row["kernel"], dict(configs=0, differ=0, largest=[0.0] * len(base)))
        k["configs"] += 1
        k["differ"] += not row["same"]
        k["largest"] = [max(a, b) for a, b in zip(k["largest"], row["largest"])]
    return dict(rows=rows, kernels=kernels, complete=complete)


def gdn_prefill(lengths: list[int], heads: int, dim: int, seed: int = 0):
    """A seeded chunk GDN prefill as vLLM 0.26 calls it (q and k L2-normalised beforehand, zero
    initial states, bf16 inputs, fp32 state): returns ``run() -> (output, final_state)`` and the
    autotuned kernels it goes through."""
    ops = importlib.import_module(f"{FLA_OPS}.chunk")
    total = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q = torch.nn.functional.normalize(randn(1, total, heads, dim), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(1, total, heads, dim), dim=-1).bfloat16()
    v = randn(1, total, heads, dim).bfloat16()
    g = torch.nn.functional.logsigmoid(randn(1, total, heads)).float()
    beta = torch.sigmoid(randn(1, total, heads)).bfloat16()
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    state = torch.zeros(len(lengths), heads, dim, dim, device="cuda")

    def run():
        out, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                output_final_state=True, cu_seqlens=cu_seqlens,
                                                use_qk_l2norm_in_kernel=False)
        torch.cuda.synchronize()
        return out, final

    return run, vllm_fla_kernels()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[192, 17])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", nargs="*", default=None, help="only kernels whose names contain one of these")
    parser.add_argument("--limit-s", type=float, default=None, help="try no further configuration after this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: vLLM's GDN prefill kernels need one; nothing run", file=sys.stderr)
        return 0
    start = time.time()
    run, tuners = gdn_prefill(args.lengths, args.heads, args.dim, args.seed)
    if args.kernels:
        tuners = {name: t for name, t in tuners.items() if any(word in name for word in args.kernels)}
    if not tuners:
        print("no autotuned flash-linear-attention kernel found (or none left by --kernels)", file=sys.stderr)
        return 1
    result = config_bits(run, tuners, args.limit_s)
    result.update(lengths=args.lengths, heads=args.heads, dim=args.dim, seed=args.seed,
                  device=torch.cuda.get_device_name(), wall_s=round(time.time() - start, 1))
    print(f"{'kernel':48} configs  differ  largest |diff| (output, state)")
    for name, k in result["kernels"].items():
        print(f"{name:48} {k['configs']:7d} {k['differ']:7d}  {k['largest'][0]:.3g}, {k['largest'][1]:.3g}")
    print(f"{len(result['rows'])} configurations in {result['wall_s']} s"
          + ("" if result["complete"] else f" (stopped at --limit-s {args.limit_s}: not all tried)"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fla_autotune_bits.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
