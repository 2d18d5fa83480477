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
with a distribution-free 95% confidence interval of that median (the
resolution the run reached), the quartiles and extremes, over ``--pairs``
pairs; and the same ratio of the engine thread's own CPU time per step.

What it measures: the whole step, as wall time and as the engine thread's
own CPU time, and, timed where they run (``HostClock``), the hook's host
work per step: the builders' ``build`` with the hook on minus without it,
plus the op guard's calls, each as the median of a window, differenced per
pair. That last one is the resolved figure: it does not carry the step's
noise. It includes what the hook's code costs in the engine, where the
model's forward between two steps has evicted it from the CPU's caches (on
this project's CPU host 3-4 times the warm loop of ``hook_host_time.py``).
What it does not measure: the op guard's zeroing kernels, which a FULL CUDA
graph captured with the guard on replays in both states (``engine_cost.py``
and ``step_guard_overhead.py`` measure the device side). Fresh rows read
stale state in the off windows: the outputs there are not checked, only
timed.

    # GPU (an engine on the H200; vLLM 0.26 bundle or the 0.34 stack)
    python benchmarks/engine_ab.py --dims qwen3-next-80b --layers 12 --gpu --out $OUT
    python benchmarks/engine_ab.py --dims bailing-2048 --layers 12 --gpu --out $OUT --name engine_ab_bailing
    # CPU, tiny model (checks the machinery)
    python benchmarks/engine_ab.py --dims tiny --batches 1 8 --pairs 10 --window-steps 8
    # as many pairs as it takes for a 95% interval 0.5% wide (or the time given per case)
    python benchmarks/engine_ab.py ... --ci-target 0.005 --max-pairs 3000 --case-seconds 240
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_cost import DIMS, _params, write_model  # noqa: E402


class HostClock:
    """Seconds the engine's thread spends in the state builders' ``build`` (vLLM's own, and the
    hook's wrapper around it where on) and in the op guard (each guarded op's call; where off, it
    returns at once), summed since ``take()``. The clock's own cost is the same in both states."""

    def __init__(self):
        self.seconds = {"builds": 0.0, "op_guard": 0.0}

    def timed(self, fn, what: str):
        seconds, clock = self.seconds, time.perf_counter

        def timed(*args, **kwargs):
            began = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[what] += clock() - began

        timed.__wrapped__ = getattr(fn, "__wrapped__", fn)
        # Marked as the hook's, so that an install() during the run (a recompile) wraps nothing more.
        from gdn_pass.vllm.builders import HOOK_MARK

        setattr(timed, HOOK_MARK, True)
        return timed

    def take(self) -> tuple[float, float]:
        """(builds, op guard) seconds since the last take."""
        taken = self.seconds["builds"], self.seconds["op_guard"]
        self.seconds["builds"] = self.seconds["op_guard"] = 0.0
        return taken


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
        self.clock = HostClock()
        from gdn_pass.vllm import guarded_ops

        # Every guarded op calls the op guard through this module attribute.
        guarded_ops.zero_fresh_state = self.clock.timed(guarded_ops.zero_fresh_state, "op_guard")

    def set(self, on: bool) -> None:
        from gdn_pass.vllm import builders, support

        for cls, hooked in self.hooked.items():
            cls.build = self.clock.timed(hooked if on else hooked.__wrapped__, "builds")
        # Off: a guarded op without a hand-off returns, as for an entry that stood down.
        stood_down = support._STOOD_DOWN
        if on:
            stood_down.difference_update(self._added)
        else:
            # every entry: an op family's guarded ops pass through only where all its builders stood down
            self._added = {entry.key for entry in builders.REGISTRY} - stood_down
            stood_down.update(self._added)
        self.on = on


def window(engine, rng, fresh: int, steps: int, clock: HostClock) -> tuple[float, float, float, float]:
    """The median seconds of ``steps`` engine steps, ``fresh`` brand-new one-token requests each:
    wall time; the engine thread's own CPU time (``time.thread_time``: not the time the thread
    was preempted by other work of a shared host; on CUDA it includes a synchronising wait where
    the driver spins); and of it, the builds' and the op guard's (``HostClock``)."""
    wall, thread, builds, guard = [], [], [], []
    for _ in range(steps):
        for _ in range(fresh):
            engine.add_request(f"f{rng.getrandbits(48)}", {"prompt_token_ids": [rng.randrange(10, 1000)]},
                               _params(1))
        clock.take()
        began, began_thread = time.perf_counter(), time.thread_time()
        engine.step()
        thread.append(time.thread_time() - began_thread)
        wall.append(time.perf_counter() - began)
        in_builds, in_guard = clock.take()
        builds.append(in_builds)
        guard.append(in_guard)
    return tuple(statistics.median(times) for times in (wall, thread, builds, guard))


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values`` (order statistics: the
    median lies below the j-th smallest of n values with probability P(Binomial(n, 1/2) < j))."""
    ordered, n = sorted(values), len(values)
    j, below = 0, 0.0  # below: P(Binomial(n, 1/2) < j + 1)
    # P(Binomial(n, 1/2) = j) in logs: exact binomial coefficients cost quadratic time in n, and
    # --ci-target asks after every pair (thousands of them)
    log_all = math.lgamma(n + 1) - n * math.log(2)
    while True:
        below_next = below + math.exp(log_all - math.lgamma(j + 1) - math.lgamma(n - j + 1))
        if below_next > (1 - level) / 2:
            break
        below, j = below_next, j + 1
    if j == 0:  # too few values for this level: the whole range
        return ordered[0], ordered[-1]
    return ordered[j - 1], ordered[n - j]


def resolved(ratios: list[float], target: float | None) -> bool:
    """Whether the 95% interval of the median on/off ratio is at most ``target`` wide (a fraction
    of the ratio: 0.005 for 0.5%); False without a target (then ``--pairs`` decides alone)."""
    if target is None or len(ratios) < 6:
        return False
    low, high = median_interval(ratios)
    return (high - low) / statistics.median(ratios) <= target


def case(llm, switch: HookSwitch, batch: int, fresh: int, pairs: int, window_steps: int, warmup: int,
         max_tokens: int, ci_target: float | None = None, max_pairs: int | None = None,
         case_seconds: float | None = None) -> dict:
    """One case: ``pairs`` ABBA pairs of windows, and with ``ci_target`` more, one at a time, until
    the 95% interval of the median ratio is that narrow, ``max_pairs`` ran or ``case_seconds``
    passed. More pairs narrow that interval (as one over the square root of their number);
    they do not narrow the quartiles (``spread``), which are the steps' own noise. The batch's
    decoders are replaced between pairs before they would run out of tokens."""
    engine = llm.llm_engine
    began = time.monotonic()
    rng = random.Random(batch * 1000 + fresh)
    decoders: list[str] = []

    def new_decoders(generation: int) -> int:
        """A new batch of decoders, past their prefills and warm-up; the tokens each has left.
        None may finish inside a window (the batch would shrink)."""
        if decoders:
            engine.abort_request(decoders)
        decoders[:] = [f"d{batch}-{fresh}-{generation}-{i}" for i in range(batch - fresh)]
        for rid in decoders:
            engine.add_request(rid, {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(32)]},
                               _params(max_tokens))
        for _ in range(4):  # their prefills, then steady decoding
            engine.step()
        window(engine, rng, fresh, warmup, switch.clock)
        return max_tokens - 4 - warmup

    from gdn_pass.vllm import handoff

    joint_before, deferral_before = handoff.joint_activity(), handoff.deferral_activity()
    tokens_left = new_decoders(0)
    on, off, ratios, thread_ratios = [], [], [], []
    host_us, builds_us, guard_us, stood_down_guard_us = [], [], [], []
    p = 0
    while p < pairs or (ci_target is not None and not resolved(ratios, ci_target) and p < (max_pairs or pairs)
                        and (case_seconds is None or time.monotonic() - began < case_seconds)):
        if tokens_left < 2 * window_steps + 8:  # between pairs: new decoders, outside the windows
            tokens_left = new_decoders(p)
        tokens_left -= 2 * window_steps
        order = (True, False) if p % 2 == 0 else (False, True)
        p += 1
        medians = {}
        for state in order:
            switch.set(state)
            medians[state] = window(engine, rng, fresh, window_steps, switch.clock)
        switch.set(True)
        on.append(medians[True][0])
        off.append(medians[False][0])
        ratios.append(medians[True][0] / medians[False][0])
        thread_ratios.append(medians[True][1] / medians[False][1])
        # The hook's host time per step, where it runs: builds and op guard, on minus off.
        builds_us.append((medians[True][2] - medians[False][2]) * 1e6)
        guard_us.append((medians[True][3] - medians[False][3]) * 1e6)
        host_us.append(builds_us[-1] + guard_us[-1])
        stood_down_guard_us.append(medians[False][3] * 1e6)
    engine.abort_request(decoders)
    while engine.has_unfinished_requests():
        engine.step()
    # The op guard's zeroing in the case's steps with the hook on (its counters): steps whose groups
    # it zeroed together, over how many groups, in how many launches (one per step where joined).
    joint = {k: v - joint_before[k] for k, v in handoff.joint_activity().items()}
    # Whether the case's builds were deferred (a replayed FULL graph's step then costs the wrappers
    # only), and where not, why (decided at each group's first build).
    deferral = handoff.deferral_activity()
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    low, high = median_interval(ratios)
    thread_low, thread_high = median_interval(thread_ratios)
    return dict(batch=batch, fresh=fresh, pairs=len(ratios), window_steps=window_steps,
                ci_width=round((high - low) / statistics.median(ratios), 5), ci_target=ci_target,
                on_ms=round(statistics.median(on) * 1e3, 4), off_ms=round(statistics.median(off) * 1e3, 4),
                ratio=round(statistics.median(ratios), 5), ratio_q1=round(q[0], 5), ratio_q3=round(q[2], 5),
                ratio_min=round(min(ratios), 5), ratio_max=round(max(ratios), 5),
                spread=round(q[2] - q[0], 5), ratio_ci95=[round(low, 5), round(high, 5)],
                thread_ratio=round(statistics.median(thread_ratios), 5),
                thread_ratio_ci95=[round(thread_low, 5), round(thread_high, 5)],
                hook_us=round(statistics.median(host_us), 2),
                hook_us_ci95=[round(v, 2) for v in median_interval(host_us)],
                builds_us=round(statistics.median(builds_us), 2), op_guard_us=round(statistics.median(guard_us), 2),
                stood_down_op_guard_us=round(statistics.median(stood_down_guard_us), 2),
                joint_steps=joint["steps"], joint_groups=joint["groups"], joint_launches=joint["launches"],
                deferred_builds=deferral["deferred_builds"] - deferral_before["deferred_builds"],
                resolved_steps=deferral["resolved_steps"] - deferral_before["resolved_steps"],
                staged_capture=deferral["staged_capture"], not_deferred=deferral["not_deferred"])


def render(result: dict) -> str:
    lines = [f"gdn-pass on/off per window in one engine: {result['dims']}, {result['layers']} layers, "
             f"{result['device']}, vLLM {result['vllm']}, torch {result['torch']}, commit {result['commit']}",
             "", "| B | fresh | on ms/step | off ms/step | on/off (median) | 95% CI of the median | quartiles "
             "| extremes | engine thread's CPU time on/off (95% CI) | hook's host time, us/step (95% CI) "
             "| of it at build / in the op guard | the guarded ops' calls where off, us | pairs x steps "
             "| the op guard's zeroing: steps, groups, launches |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        (low, high), (t_low, t_high) = r["ratio_ci95"], r["thread_ratio_ci95"]
        h_low, h_high = r["hook_us_ci95"]
        lines.append(f"| {r['batch']} | {r['fresh']} | {r['on_ms']:.3f} | {r['off_ms']:.3f} | x{r['ratio']:.4f} | "
                     f"{low:.4f}-{high:.4f} | {r['ratio_q1']:.4f}-{r['ratio_q3']:.4f} | "
                     f"{r['ratio_min']:.4f}-{r['ratio_max']:.4f} | x{r['thread_ratio']:.4f} ({t_low:.4f}-{t_high:.4f}) | "
                     f"{r['hook_us']:.1f} ({h_low:.1f}-{h_high:.1f}) | {r['builds_us']:.1f} / {r['op_guard_us']:.1f} | "
                     f"{r['stood_down_op_guard_us']:.1f} | "
                     f"{r['pairs']} x {r['window_steps']} | "
                     f"{r.get('joint_steps', '')}, {r.get('joint_groups', '')}, {r.get('joint_launches', '')} |")
    not_deferred = {k: v for r in result["cases"] for k, v in r.get("not_deferred", {}).items()}
    if result["cases"] and "deferred_builds" in result["cases"][0]:
        lines += ["", "Deferred builds (hook on) per case: " + ", ".join(
            f"B = {r['batch']} fresh {r['fresh']}: {r['deferred_builds']}, {r['resolved_steps']} steps resolved"
            for r in result["cases"])
            + ("; a capture zeroed through staged rows (no build deferred after it)"
               if any(r["staged_capture"] for r in result["cases"]) else "")
            + "".join(f"; {key} not deferred: {why}" for key, why in not_deferred.items())]
    return "\n".join(lines) + "\n"


def engine_arguments(ap: argparse.ArgumentParser, *, batches: list[int], name: str) -> None:
    """The options of ``engine_for``'s engine and of where results go, shared with ``hook_in_engine.py``."""
    ap.add_argument("--dims", choices=DIMS, default="tiny")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--gpu", action="store_true", help="CUDA settings (memory, GDN prefill backend)")
    ap.add_argument("--batches", type=int, nargs="+", default=batches)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    ap.add_argument("--workdir", default=f"artifacts/{name}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default=name)


def engine_for(args):
    """The one engine the windows run in, compiled with GDNStatePass: ``args.dims``' model with
    ``args.layers`` layers, room for the largest of ``args.batches``, CUDA settings with ``args.gpu``."""
    from gdn_pass.vllm.checker.scenarios import make_llm

    model = write_model(args.dims, args.layers, Path(args.workdir) / f"model_{args.dims}_{args.layers}")
    engine_args = dict(load_format="auto" if args.dims.endswith("tiny") else "dummy",
                       trust_remote_code=args.dims.startswith("bailing"), max_num_seqs=max(4, *args.batches) + 1,
                       max_model_len=args.max_model_len, num_gpu_blocks_override=None,
                       max_num_batched_tokens=8192, enable_prefix_caching=False)
    if args.gpu:
        engine_args.update(kv_cache_memory_bytes=args.kv_cache_bytes, gpu_memory_utilization=0.05,
                           additional_config={"gdn_prefill_backend": "triton"})
    return make_llm(str(model), guard=True, **engine_args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_arguments(ap, batches=[1, 8, 64, 256], name="engine_ab")
    ap.add_argument("--pairs", type=int, default=40, help="on/off pairs of windows per case (at least)")
    ap.add_argument("--ci-target", type=float, default=None,
                    help="then more pairs until the 95%% interval of the median ratio is this narrow "
                         "(a fraction: 0.005 = 0.5%%), up to --max-pairs and --case-seconds")
    ap.add_argument("--max-pairs", type=int, default=2000)
    ap.add_argument("--case-seconds", type=float, default=None, help="time limit per case for --ci-target")
    ap.add_argument("--window-steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--fresh", type=int, nargs="+", choices=(0, 1), default=[0, 1],
                    help="the cases per B: 0 without a fresh row, 1 with one (default: both)")
    args = ap.parse_args()

    llm = engine_for(args)
    switch = HookSwitch()
    cases = []
    for batch in args.batches:
        for fresh in sorted(set(args.fresh)):
            if fresh <= batch:
                cases.append(case(llm, switch, batch, fresh, args.pairs, args.window_steps, args.warmup,
                                  args.max_model_len - 64, args.ci_target, args.max_pairs, args.case_seconds))
                print(json.dumps(cases[-1]), flush=True)
    return finish(args, cases, render, "benchmarks/engine_ab.py")


def finish(args, cases: list, render, script: str) -> int:
    """The run's result (release, device, commit, command, cases), printed as ``render`` makes it
    and, with ``args.out``, written there as ``args.name`` .json and .md."""
    import subprocess

    import torch
    import vllm

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    result = dict(dims=args.dims, layers=args.layers, vllm=vllm.__version__, torch=torch.__version__,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine(),
                  commit=commit, command="python " + " ".join([script, *sys.argv[1:]]), cases=cases)
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
