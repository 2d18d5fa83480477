"""gdn-pass's cost inside one engine: the metadata hook switched on and off per window of steps.

Two engines in separate processes cannot resolve a 0.5% effect on a
host-bound step (``engine_cost.md``: every variant's rounds swing 10-40%,
plain vLLM against itself included). Here one engine, compiled with
GDNStatePass, runs the same case in windows of steps that alternate
``on, off, off, on, on, off, ...`` (ABBA: a drift of the machine within a
pair weighs on both states alike), in one process, on the same caches and
CUDA graphs. Off: every registered builder's ``build`` is vLLM's own (the
hook's wrapper taken off the class) and the op guard finds no hand-off, as
where its entry stood down, and returns. Reported per case: the median step
of each window, and the ratio on/off of each adjacent pair, as its median
with the quartiles and extremes, over ``--pairs`` pairs.

What it measures: the hook's host work and the step guard's zeroing launches
(both on the engine's thread, before the forward). What it does not: the op
guard's zeroing kernels, which a FULL CUDA graph captured with the guard on
replays in both states (``engine_cost.py`` and ``step_guard_overhead.py``
measure the device side). Fresh rows read stale state in the off windows:
the outputs there are not checked, only timed.

    # GPU (an engine on the H200; vLLM 0.26 bundle or the 0.34 stack)
    python benchmarks/engine_ab.py --dims qwen3-next-80b --layers 12 --gpu --out $OUT
    python benchmarks/engine_ab.py --dims bailing-2048 --layers 12 --gpu --out $OUT --name engine_ab_bailing
    # CPU, tiny model (checks the machinery)
    python benchmarks/engine_ab.py --dims tiny --batches 1 8 --pairs 10 --window-steps 8
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_cost import DIMS, _params, write_model  # noqa: E402


class HookSwitch:
    """Puts gdn-pass's metadata hook on and off every registered builder class of this process."""

    def __init__(self):
        from gdn_pass.vllm import builders

        self.hooked = {cls: cls.__dict__["build"] for _, cls in builders.installed()
                       if getattr(cls.__dict__.get("build"), builders.HOOK_MARK, False)}
        if not self.hooked:
            raise RuntimeError("no builder class carries gdn-pass's hook in this process")
        self.on = True
        self._added: set[str] = set()  # the entries marked stood down while off

    def set(self, on: bool) -> None:
        from gdn_pass.vllm import support

        for cls, hooked in self.hooked.items():
            cls.build = hooked if on else hooked.__wrapped__
        # Off: a guarded op without a hand-off returns, as for an entry that stood down.
        stood_down = support._STOOD_DOWN
        if on:
            stood_down.difference_update(self._added)
        else:
            self._added = {"gdn"} - stood_down
            stood_down.update(self._added)
        self.on = on


def window(engine, rng, fresh: int, steps: int) -> float:
    """The median seconds of ``steps`` engine steps, ``fresh`` brand-new one-token requests each."""
    times = []
    for _ in range(steps):
        for _ in range(fresh):
            engine.add_request(f"f{rng.getrandbits(48)}", {"prompt_token_ids": [rng.randrange(10, 1000)]},
                               _params(1))
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def case(llm, switch: HookSwitch, batch: int, fresh: int, pairs: int, window_steps: int, warmup: int,
         max_tokens: int) -> dict:
    engine = llm.llm_engine
    rng = random.Random(batch * 1000 + fresh)
    decoders = [f"d{batch}-{fresh}-{i}" for i in range(batch - fresh)]
    for rid in decoders:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(32)]},
                           _params(max_tokens))
    for _ in range(4):  # their prefills, then steady decoding
        engine.step()
    window(engine, rng, fresh, warmup)
    on, off, ratios = [], [], []
    for p in range(pairs):
        order = (True, False) if p % 2 == 0 else (False, True)
        medians = {}
        for state in order:
            switch.set(state)
            medians[state] = window(engine, rng, fresh, window_steps)
        switch.set(True)
        on.append(medians[True])
        off.append(medians[False])
        ratios.append(medians[True] / medians[False])
    engine.abort_request(decoders)
    while engine.has_unfinished_requests():
        engine.step()
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return dict(batch=batch, fresh=fresh, pairs=pairs, window_steps=window_steps,
                on_ms=round(statistics.median(on) * 1e3, 4), off_ms=round(statistics.median(off) * 1e3, 4),
                ratio=round(statistics.median(ratios), 5), ratio_q1=round(q[0], 5), ratio_q3=round(q[2], 5),
                ratio_min=round(min(ratios), 5), ratio_max=round(max(ratios), 5),
                spread=round(q[2] - q[0], 5))


def render(result: dict) -> str:
    lines = [f"gdn-pass on/off per window in one engine: {result['dims']}, {result['layers']} layers, "
             f"{result['device']}, vLLM {result['vllm']}, torch {result['torch']}, commit {result['commit']}",
             "", "| B | fresh | on ms/step | off ms/step | on/off (median) | quartiles | extremes | pairs x steps |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        lines.append(f"| {r['batch']} | {r['fresh']} | {r['on_ms']:.3f} | {r['off_ms']:.3f} | x{r['ratio']:.4f} | "
                     f"{r['ratio_q1']:.4f}-{r['ratio_q3']:.4f} | {r['ratio_min']:.4f}-{r['ratio_max']:.4f} | "
                     f"{r['pairs']} x {r['window_steps']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", choices=DIMS, default="tiny")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--gpu", action="store_true", help="CUDA settings (memory, GDN prefill backend)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--pairs", type=int, default=40, help="on/off pairs of windows per case")
    ap.add_argument("--window-steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    ap.add_argument("--workdir", default="artifacts/engine_ab")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="engine_ab")
    args = ap.parse_args()

    import subprocess

    import torch

    from gdn_pass.vllm.checker.scenarios import make_llm

    model = write_model(args.dims, args.layers, Path(args.workdir) / f"model_{args.dims}_{args.layers}")
    engine_args = dict(load_format="auto" if args.dims.endswith("tiny") else "dummy",
                       trust_remote_code=args.dims.startswith("bailing"), max_num_seqs=max(4, *args.batches) + 1,
                       max_model_len=args.max_model_len, num_gpu_blocks_override=None,
                       max_num_batched_tokens=8192, enable_prefix_caching=False)
    if args.gpu:
        engine_args.update(kv_cache_memory_bytes=args.kv_cache_bytes, gpu_memory_utilization=0.05,
                           additional_config={"gdn_prefill_backend": "triton"})
    llm = make_llm(str(model), guard=True, **engine_args)
    switch = HookSwitch()
    import vllm

    cases = []
    for batch in args.batches:
        for fresh in sorted({0, 1}):
            if fresh <= batch:
                cases.append(case(llm, switch, batch, fresh, args.pairs, args.window_steps, args.warmup,
                                  args.max_model_len - 64))
                print(json.dumps(cases[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    result = dict(dims=args.dims, layers=args.layers, vllm=vllm.__version__, torch=torch.__version__,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine(),
                  commit=commit, command=" ".join(sys.argv), cases=cases)
    text = render(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{args.name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
