"""Where the metadata hook's host time goes inside one engine: the step check against the rest.

``hook_host_time.py`` times each line of the hook in a loop, where they add
up to about a quarter of what the hook costs in an engine (``engine_ab.py``):
there the model's forward between two steps has evicted the hook's code and
data from the CPU's caches, and line timings taken in a warm loop do not say
which line pays for that. This benchmark splits the in-engine cost itself.
One engine, compiled with GDNStatePass, runs windows of steps without fresh
rows in four states, their order rotated through every permutation from one
round to the next:

- ``off``: vLLM's own builds (``engine_ab.HookSwitch``);
- ``on``: the hook as shipped;
- ``answered``: the hook with its step check (``rows.has_new_rows``, the
  question every build asks first) replaced by its answer on these steps,
  False. Nothing else changes: the same builds, hand-offs and guards run. The
  run stops if a step of an ``on`` window had its rows computed (the check
  found a new row, or could not rule one out): there ``answered`` would be a
  different hook, not only a faster one;
- ``kept``: ``answered``, with every step's ``CommonAttentionMetadata`` kept
  alive until the case ends. The hook keeps the last step's (for a FULL CUDA
  graph's capture) and lets it go at the next step's build, where vLLM's
  last reference to it may already be gone: freeing it and its tensors then
  happens inside the build, work vLLM would otherwise do elsewhere in the
  step. ``answered - kept`` is that work.

Per round it takes each window's median per step of the time in the builders'
``build`` plus the guarded ops' calls of the op guard (``engine_ab.HostClock``:
where the hook's work runs; a deferred build's rows are made in the step's
first guarded op), and reports, as medians over rounds with a
distribution-free 95% interval: the hook (``on - off``), its step check
(``on - answered``), the rest of it (``answered - off``: the wrappers, the
hand-off, the group's cache check), and of the rest the freeing of the last
step's metadata (``answered - kept``).

    python benchmarks/hook_in_engine.py --dims tiny --batches 1 8 --rounds 60 --out DIR
    python benchmarks/hook_in_engine.py --dims qwen3-next-80b --layers 12 --gpu --batches 1 8 --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_ab import (  # noqa: E402
    HookSwitch, engine_arguments, engine_for, finish, median_interval, window)
from benchmarks.engine_cost import _params  # noqa: E402

STATES = ("off", "on", "answered", "kept")


class StepCheck:
    """Switches the metadata hook's step check between the real one and its answer on steps without
    a new row, and tells whether the real one found a step it could not prove idle."""

    def __init__(self):
        from gdn_pass.vllm import metadata_hook, rows

        self.hook, self.rows = metadata_hook, rows
        self.real = metadata_hook.has_new_rows
        self.windows_with_rows = 0
        self.kept: list = []

    def set(self, state: str) -> None:
        if state == "answered":
            self.hook.has_new_rows = lambda common: False
        elif state == "kept":
            self.hook.has_new_rows = lambda common: self.kept.append(common) or False
        else:
            self.hook.has_new_rows = self.real

    def window(self, run):
        """``run()`` under the real check; counted where a step of it had its rows computed (a new
        row, or one the check could not rule out: ``rows.scheduler_rows`` keeps each such step)."""
        before = self.rows._last_step[0]
        try:
            return run()
        finally:
            self.windows_with_rows += self.rows._last_step[0] is not before


def case(llm, switch: HookSwitch, check: StepCheck, batch: int, rounds: int, window_steps: int,
         max_tokens: int) -> dict:
    if rounds * len(STATES) * window_steps + 4 + window_steps >= max_tokens:
        raise SystemExit(f"--rounds {rounds} x {len(STATES)} windows of {window_steps} steps outlast the "
                         f"decoders' {max_tokens} tokens: fewer rounds or a longer --max-model-len")
    engine = llm.llm_engine
    rng = random.Random(batch)
    decoders = [f"d{batch}-{i}" for i in range(batch)]
    for rid in decoders:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(32)]},
                           _params(max_tokens))
    for _ in range(4 + window_steps):  # their prefills, then steady decoding
        engine.step()
    check.windows_with_rows = 0  # the windows' steps only (the prefills above had new rows)
    orders = list(itertools.permutations(STATES))
    per_state = {state: [] for state in STATES}
    for r in range(rounds):
        for state in orders[r % len(orders)]:
            switch.set(state != "off")
            check.set(state)
            run = lambda: sum(window(engine, rng, 0, window_steps, switch.clock)[2:])  # noqa: E731
            per_state[state].append(check.window(run) if state == "on" else run())
    switch.set(True)
    check.set("on")
    check.kept.clear()
    engine.abort_request(decoders)
    while engine.has_unfinished_requests():
        engine.step()
    if check.windows_with_rows:
        raise SystemExit(f"B = {batch}: {check.windows_with_rows} 'on' windows had a step the check did not "
                         "prove free of new rows: 'answered' is not the same hook on such steps")

    def split(minuend: str, subtrahend: str) -> dict:
        values = [(a - b) * 1e6 for a, b in zip(per_state[minuend], per_state[subtrahend])]
        low, high = median_interval(values)
        return dict(us=round(statistics.median(values), 2), ci95=[round(low, 2), round(high, 2)])

    return dict(batch=batch, rounds=rounds, window_steps=window_steps,
                off_builds_us=round(statistics.median(per_state["off"]) * 1e6, 2),
                hook=split("on", "off"), step_check=split("on", "answered"), rest=split("answered", "off"),
                freeing=split("answered", "kept"))


def render(result: dict) -> str:
    lines = [f"# The metadata hook's host time inside one engine, split ({result['dims']}, {result['layers']} layers)",
             "", f"vLLM {result['vllm']}, torch {result['torch']}, {result['device']}, commit `{result['commit']}`.", "",
             f"    {result['command']}", "",
             "| B | vLLM's builds and the guarded ops' calls, us/step | hook (on - off), us/step (95% CI) | of it the step check (on - answered) "
             "| the rest (answered - off) | of the rest, freeing the last step's metadata (answered - kept) "
             "| rounds x steps |", "|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        cells = [f"{c[k]['us']:.1f} ({c[k]['ci95'][0]:.1f} to {c[k]['ci95'][1]:.1f})" for k in ("hook", "step_check", "rest", "freeing")]
        lines.append(f"| {c['batch']} | {c['off_builds_us']:.1f} | {' | '.join(cells)} | {c['rounds']} x {c['window_steps']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_arguments(ap, batches=[1, 8], name="hook_in_engine")
    ap.add_argument("--rounds", type=int, default=60, help="windows of each state per case")
    ap.add_argument("--window-steps", type=int, default=10)
    args = ap.parse_args()

    llm = engine_for(args)
    switch, check = HookSwitch(), StepCheck()
    cases = []
    for batch in args.batches:
        cases.append(case(llm, switch, check, batch, args.rounds, args.window_steps, args.max_model_len - 64))
        print(json.dumps(cases[-1]), flush=True)
    return finish(args, cases, render, "benchmarks/hook_in_engine.py")


if __name__ == "__main__":
    sys.exit(main())
