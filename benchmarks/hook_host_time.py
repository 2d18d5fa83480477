"""Host time gdn-pass's metadata hook adds to one engine step of vLLM's GDN metadata builders.

Real ``GDNAttentionMetadataBuilder`` s (this process's vLLM), configured with
GDNStatePass, on CUDA where there is one: one builder per KV-cache group of
GDN layers, each group with its own layers' caches at Qwen3-Next's per-layer
state shapes. A step is built as vLLM's runner builds it: one
``CommonAttentionMetadata`` per step (a new view of a persistent host buffer
for ``query_start_loc_cpu``), shallow-copied per group, then each group's
``build``. Qwen3-Next-80B has 36 GDN layers in 3 groups of 12 (the default).
``--builder bailing``: Bailing-MoE-v2.5's Lightning builders instead, behind
the guarded twin of ``vllm::linear_attention`` as in a compiled engine (the op
guard owns them); with ``--step-guard`` behind no guarded op, as in an eager
engine (the step guard owns them: a step with fresh rows zeroes at build, one
launch per group).

Each case times the same steps with the hook (``builder.build``) and
without it (``builder.build.__wrapped__``, vLLM's own build), interleaved in
blocks, and reports per step:

    rows B, fresh k      the step: B one-token rows in vLLM's decode order,
                         k of them brand new (fresh decode rows, to zero);
                         B -> P: B rows without new ones, padded to a FULL
                         graph's P rows as vLLM's runner pads them
    vllm_us              vLLM's builds alone, median per step
    hook_us              the hook's host time per step (with - without)
    first / later        (steps without fresh rows) the hook's time in the step's
                         first build, which decides whether the step has a new
                         row, and in each later build, which reuses that
    --forward            the hook's time includes the guarded ops of the step's
                         forward (``Forward``): on CUDA, a step with fresh rows
                         makes its zeroing launch(es) there
    busy_us              (CUDA, fresh steps) one step's builds with the hook,
                         enqueued behind a 2 ms GPU sleep: near hook_us +
                         vllm_us when the hook never waits for the stream

    python benchmarks/hook_host_time.py [--groups 3] [--layers-per-group 12]
        [--batches 1 8 64 256] [--padded-batches 5:8 40:64] [--repeat 400] [--breakdown] [--in-context]
        [--inference-host-tensors] [--forward] [--cuda-path-on-cpu] [--builder gdn|bailing] [--step-guard]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_builders(device: torch.device, num_blocks: int, groups: int, layers_per_group: int,
                  kind: str = "gdn", full_graphs_on_cpu: bool = False, guarded: bool = True) -> list:
    """``groups`` configured builders of ``kind`` over poisoned-free caches in vLLM's static forward context.

    ``gdn``: ``GDNAttentionMetadataBuilder`` over Qwen3-Next's per-layer state shapes, every layer
    behind a guarded op. ``bailing``: ``BailingLinearAttentionMetadataBuilder`` (Lightning) over a
    Bailing-MoE-v2.5 state at hidden 2048 (16 heads of 128). ``guarded``: every layer behind a
    guarded op (a compiled engine's case: the op guard owns the groups); else none (an eager
    engine's: the step guard owns them and zeroes at build)."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import MambaSpec

    from gdn_pass.vllm import VllmGDNStatePass, metadata_hook, step_guard

    try:  # the prefill-backend probe reads a model config on CUDA; there is no model here
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

        qwen_gdn_linear_attn._resolve_gdn_prefill_backend = lambda cfg: ("triton", "triton")
    except ImportError:
        pass
    metadata_hook.install()
    config = VllmConfig(
        compilation_config=CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()}),
        additional_config={"gdn_prefill_backend": "triton"})
    config.scheduler_config.max_num_seqs = max(config.scheduler_config.max_num_seqs, num_blocks)
    if full_graphs_on_cpu:  # set after VllmConfig, which turns CUDA graphs off on a CPU platform
        from vllm.config import CUDAGraphMode

        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    context = config.compilation_config.static_forward_context
    if kind == "gdn":
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as builder_class

        shapes, dtypes = ((3, 8192), (32, 128, 128)), (torch.bfloat16, torch.float32)
        suffix = "linear_attn"
    else:
        from vllm.v1.attention.backends.linear_attn import BailingLinearAttentionMetadataBuilder as builder_class

        shapes, dtypes = ((16, 128, 128),), (torch.float32,)
        suffix = "attention"
    spec = MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes)
    builders = []
    for group in range(groups):
        names = [f"model.layers.{group * layers_per_group + i}.{suffix}" for i in range(layers_per_group)]
        for name in names:  # the per-layer state shapes, small slot count
            context[name] = SimpleNamespace(kv_cache=[
                torch.zeros(num_blocks, *shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)])
            if guarded:  # every layer has a guarded op (the compiled engine's case): the op guard owns the group
                step_guard.note_guarded_layer(name)
        with set_current_vllm_config(config):
            builders.append(builder_class(spec, names, config, device))
    return builders


class Steps:
    """One step's scheduler metadata, made anew per step from persistent buffers as vLLM's runner does."""

    def __init__(self, batch: int, fresh: int, device: torch.device, padded_to: int | None = None,
                 inference: bool = False):
        """``padded_to``: the ``batch`` real rows padded to a captured FULL-graph size, as vLLM's
        runner pads them (counted in ``num_reqs``, no token, sequence length 0, block 0).
        ``inference``: the host tensors are inference tensors (made under ``torch.inference_mode``,
        no version counter), as vLLM 0.34's V2 runner makes them."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        self.cls = CommonAttentionMetadata
        self.inference = inference
        rows = padded_to or batch
        computed = [0] * fresh + [17] * (batch - fresh)
        self.batch = rows
        with torch.inference_mode(inference):
            self.query_start_loc = torch.tensor(list(range(batch + 1)) + [batch] * (rows - batch),
                                                dtype=torch.int32)
            self.seq_lens_cpu = torch.tensor([c + 1 for c in computed] + [0] * (rows - batch), dtype=torch.int32)
        self.query_start_loc_gpu = self.query_start_loc.to(device)
        self.seq_lens = self.seq_lens_cpu.to(device)
        self.max_seq_len = int(self.seq_lens_cpu.max())
        blocks = list(range(1, batch + 1)) + [0] * (rows - batch)
        self.block_table = torch.tensor(blocks, dtype=torch.int32, device=device).view(-1, 1)
        self.slot_mapping = torch.zeros(rows, dtype=torch.int64, device=device)

    def common(self):
        n = self.batch
        with torch.inference_mode(self.inference):
            return self._common(n)

    def _common(self, n: int):
        return self.cls(
            query_start_loc=self.query_start_loc_gpu, query_start_loc_cpu=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens, num_reqs=n, num_actual_tokens=n, max_query_len=1,
            max_seq_len=self.max_seq_len, block_table_tensor=self.block_table, slot_mapping=self.slot_mapping,
            seq_lens_cpu_upper_bound=self.seq_lens_cpu[:n])


class Forward:
    """The step's forward as the guards see it (``--forward``): every layer's guarded op calls the op
    guard (``op_guard.zero_fresh_state``) with the step's metadata, as a compiled engine's piecewise
    forward does, so that a step with fresh rows makes its zeroing launches here. vLLM's forward
    context is this object's (``get_forward_context`` replaced: what it costs is a global read)."""

    def __init__(self, builders, family: str = "gdn"):
        import vllm.forward_context

        from gdn_pass.vllm import op_guard
        from gdn_pass.vllm.metadata_hook import state_of

        self.zero, self.family = op_guard.zero_fresh_state, family
        # What vLLM gave each builder, as the hook kept it (0.26's builders keep no layer_names)
        contexts = [state_of(b).context for b in builders]
        self.groups = [list(c.layer_names) for c in contexts]
        static = contexts[0].vllm_config.compilation_config.static_forward_context
        self.context = SimpleNamespace(no_compile_layers={n: static[n] for g in self.groups for n in g},
                                       attn_metadata=None)
        vllm.forward_context.get_forward_context = lambda: self.context

    def run(self, metadata: list) -> None:
        self.context.attn_metadata = {n: m for names, m in zip(self.groups, metadata) for n in names}
        for names in self.groups:
            for name in names:
                self.zero(name, self.family)


def build_step(builders, steps: Steps, hooked: bool, forward: Forward | None = None) -> None:
    """One step's builds (and, hooked with ``forward``, its guarded ops)."""
    base = steps.common()
    built = []
    for builder in builders:
        build = builder.build if hooked else builder.build.__wrapped__.__get__(builder)
        built.append(build(common_prefix_len=0, common_attn_metadata=copy.copy(base)))
    if hooked and forward is not None:
        forward.run(built)


def time_steps(builders, steps: Steps, repeat: int, sync, forward: Forward | None = None) -> tuple[float, float]:
    """Median us per step: (with the hook, vLLM's builds alone), interleaved in blocks of 20."""
    hooked, plain = [], []
    for _ in range(repeat // 20):
        for on, out in ((True, hooked), (False, plain)):
            start = time.perf_counter()
            for _ in range(20):
                build_step(builders, steps, on, forward)
            out.append((time.perf_counter() - start) / 20 * 1e6)
        sync()
    return statistics.median(hooked), statistics.median(plain)


def split_idle_us(builders, steps: Steps, repeat: int, sync) -> tuple[float, float]:
    """On a step without new rows, the hook's median us in the step's first build (which computes the
    step's scheduler rows, ``rows.scheduler_rows``) and in each later build (which reuses them)."""
    plain = [b.build.__wrapped__.__get__(b) for b in builders]
    first, later = [], []
    for _ in range(repeat // 20):
        spent = dict(hooked_first=0.0, hooked_later=0.0, plain_first=0.0, plain_later=0.0)
        for _ in range(20):
            for kind, builds in (("hooked", [b.build for b in builders]), ("plain", plain)):
                base = steps.common()
                copies = [copy.copy(base) for _ in builds]
                start = time.perf_counter()
                builds[0](common_prefix_len=0, common_attn_metadata=copies[0])
                middle = time.perf_counter()
                for build, common in zip(builds[1:], copies[1:]):
                    build(common_prefix_len=0, common_attn_metadata=common)
                spent[f"{kind}_first"] += middle - start
                spent[f"{kind}_later"] += time.perf_counter() - middle
        first.append((spent["hooked_first"] - spent["plain_first"]) / 20 * 1e6)
        later.append((spent["hooked_later"] - spent["plain_later"]) / 20 / max(1, len(builders) - 1) * 1e6)
        sync()
    return statistics.median(first), statistics.median(later)


def step_activity(builders, steps: Steps, forward: Forward) -> dict:
    """What one hooked step with ``forward`` did (``--forward``), counted by the guards themselves:
    ``deferred``, whether a guarded op resolved the step's deferred builds (they are deferred in an
    engine that captures FULL graphs); ``launches``, the op guard's zeroing launches (one where the
    step's groups were zeroed together)."""
    from gdn_pass.vllm import handoff

    joint, deferral = handoff.joint_activity(), handoff.deferral_activity()
    build_step(builders, steps, True, forward)
    return dict(deferred=handoff.deferral_activity()["resolved_steps"] - deferral["resolved_steps"],
                launches=handoff.joint_activity()["launches"] - joint["launches"])


def busy_step_us(builders, steps: Steps, forward: Forward | None = None) -> float:
    """Host time of one step's hooked builds enqueued behind 2 ms of GPU work."""
    torch.cuda.synchronize()
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 2e-3)  # kHz -> cycles in 2 ms
    times = []
    for _ in range(5):
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        build_step(builders, steps, True, forward)
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _same_parameters(function, body: str, **names):
    """A function with ``function``'s own parameters (no annotations) whose body is ``body``, made
    with ``exec``, as any function that keeps an arbitrary builder's signature has to be made."""
    import inspect

    parameters = list(inspect.signature(function).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in parameters):
        raise ValueError(f"{function.__qualname__}: only named parameters are reproduced")
    defaults = {f"_default_{p.name}": p.default for p in parameters if p.default is not p.empty}
    declared = []
    for p in parameters:
        if p.kind is p.KEYWORD_ONLY and "*" not in declared:
            declared.append("*")
        declared.append(p.name if p.default is p.empty else f"{p.name}=_default_{p.name}")
    declared = ", ".join(declared)
    namespace = {**names, **defaults}
    body = body.format(passed=", ".join(p.name if p.kind is p.POSITIONAL_OR_KEYWORD else f"{p.name}={p.name}"
                                        for p in parameters))
    exec(f"def made({declared}):\n    {body}\n", namespace)  # noqa: S102
    return namespace["made"]


def wrapper_call_us(build, kwargs: dict, best) -> tuple[float, float]:
    """What a wrapper's own call adds around ``build`` called with ``kwargs``, in us: a wrapper of
    ``*args, **kwargs`` (the hook's), and one with ``build``'s own parameters, which Python need not
    pack into a tuple and a dict and unpack again. Both wrap a function with ``build``'s parameters
    that does nothing, so the build's own time (its spread is larger than these) is not in them."""
    nothing = _same_parameters(build, "return None")

    def generic(*args, **kwargs):
        return nothing(*args, **kwargs)

    own = _same_parameters(build, "return _nothing({passed})", _nothing=nothing)
    alone = best(lambda: nothing(None, **kwargs))
    return best(lambda: generic(None, **kwargs)) - alone, best(lambda: own(None, **kwargs)) - alone


def idle_breakdown(builders, steps: Steps, number: int = 20000) -> dict[str, float]:
    """Where a step without new rows spends the hook's time, line by line, in us: each piece
    timed alone (best of 5 runs of ``number`` calls) on this step's real metadata, as the hook's
    short path runs it (``metadata_hook._guard_step``, ``rows.has_new_rows``)."""
    import timeit

    from gdn_pass.vllm import metadata_hook, rows

    builder = builders[-1]
    state = metadata_hook.state_of(builder)
    plain = type(builder).build.__wrapped__
    common = steps.common()
    metadata = plain(builder, common_prefix_len=0, common_attn_metadata=common)
    kwargs = dict(common_prefix_len=0, common_attn_metadata=common)

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    generic_call, own_parameters_call = wrapper_call_us(plain, kwargs, best)

    starts = common.query_start_loc_cpu
    tensor, field = rows.host_lengths(common)
    lengths = rows.host_array(tensor, common.num_reqs)

    def first_check():
        rows._last_idle_key[0] = None
        rows.has_new_rows(common)

    rows.has_new_rows(common)
    spent = {
        "wrapper call (*args, **kwargs) around vLLM's build": generic_call,
        "  the same, a wrapper with build's own parameters (no packing)": own_parameters_call,
        "_guard_step, the whole short path (a later build)": best(
            lambda: metadata_hook._guard_step(builder, state, plain, (), kwargs, metadata)),
        "  has_new_rows, a later build (step found by identity)": best(lambda: rows.has_new_rows(common)),
        "  has_new_rows, the step's first build": best(first_check),
        "    host_lengths": best(lambda: rows.host_lengths(common)),
        "    host_array": best(lambda: rows.host_array(tensor, common.num_reqs)),
        "    argmin and compare": best(lambda: lengths[lengths.argmin()] > common.max_query_len),
        "    _step_key": best(lambda: rows._step_key(common, starts, tensor, field)),
        "  the group's caches unchanged (identity)": best(
            lambda: getattr(state.forward_context.get(state.first_name), "kv_cache", None) is state.first_kv_cache),
        "  setattr of the hand-off": best(lambda: setattr(metadata, "gdn_pass_handoff", state.idle)),
    }
    if starts.is_inference():
        def version_read_raising():  # what _step_key did for inference tensors before it asked is_inference()
            try:
                return starts._version
            except RuntimeError:
                return None

        spent["    (a version counter read that raises, as _step_key read it before)"] = best(version_read_raising)
    rows.has_new_rows(common)
    return {name: round(us, 2) for name, us in spent.items()}


def in_context(builders, steps: Steps, rounds: int, sync) -> dict[str, dict[str, float]]:
    """What each part of the hook costs inside real steps, not alone: the step's builds timed (blocks
    of 20 steps, interleaved round by round, in a new order each round) with one more part of the
    hook each, from vLLM's builds alone to the whole hook, on a step without new rows. Per part, the
    median over rounds of its step time minus the same round's step time without it, us a step,
    with the quartiles; vLLM's builds alone run twice, and their difference is the method's zero. A line
    timed alone (``--breakdown``) runs hot in a loop of its own; inside a step it runs after vLLM's
    build has run, and costs what that leaves it."""
    from gdn_pass.vllm import metadata_hook

    originals = [type(b).build.__wrapped__ for b in builders]
    hooked = [type(b).build for b in builders]

    def generic(original):
        def build(self, *args, **kwargs):
            return original(self, *args, **kwargs)
        return build

    patched = ("_guard_step", "_attach_idle", "defer")
    real = {name: getattr(metadata_hook, name) for name in patched}
    # The hook's step check doing nothing: the generic wrapper's _guard_step, and _attach_idle (the
    # own-parameters wrapper's check of a build it does not defer) saying "no new row, attached".
    check_nothing = {"_guard_step": lambda builder, state, original, args, kwargs, metadata, inputs=None: metadata,
                     "_attach_idle": lambda state, common, metadata: True}
    own_parameters = [_same_parameters(o, "return _original({passed})", _original=o) for o in originals]
    wrapper_only = "a wrapper with build's own parameters that only calls build"
    # (name, builds, the hook's functions replaced, the part it adds to): each with one part more than
    # the one before it, but for the *args, **kwargs wrapper, which the hook's own-parameters wrapper
    # replaces (``metadata_hook._own_parameters_build``) and which is timed here for comparison.
    parts = [("vLLM's builds alone", originals, {}, None),
             ("vLLM's builds alone again (the method's zero)", originals, {}, "vLLM's builds alone"),
             (wrapper_only, own_parameters, {}, "vLLM's builds alone again (the method's zero)"),
             ("(for comparison) a wrapper of *args, **kwargs instead, what packing the arguments costs",
              [generic(o) for o in originals], {}, wrapper_only)]
    if all(metadata_hook.state_of(b).deferred is not None for b in builders):
        checks = "the hook's wrapper: its state and deferral checks, cache identity, kept inputs; defer doing nothing"
        parts += [(checks, hooked, {"defer": lambda metadata, deferred: metadata}, wrapper_only),
                  ("the hook: defer (the weak reference, the note, the attach)", hooked, {}, checks)]
    else:
        reads = "the hook's wrapper (its state and mode reads), its step check doing nothing"
        parts += [(reads, hooked, check_nothing, wrapper_only),
                  ("the hook: its step check (_attach_idle, or _guard_step where the generic wrapper runs)",
                   hooked, {}, reads)]

    def step(builds):
        base = steps.common()
        for builder, build in zip(builders, builds):
            build(builder, common_prefix_len=0, common_attn_metadata=copy.copy(base))

    def replace(functions: dict) -> None:
        for name in patched:
            setattr(metadata_hook, name, functions.get(name, real[name]))

    times: dict[str, list[float]] = {name: [] for name, *_ in parts}
    try:
        for _ in range(20):  # warm-up
            for _, builds, functions, _ in parts:
                replace(functions)
                step(builds)
        order = random.Random(0)
        for _ in range(rounds):
            # each round in its own order: no part always follows the same one
            for name, builds, functions, _ in order.sample(parts, len(parts)):
                replace(functions)
                start = time.perf_counter()
                for _ in range(20):
                    step(builds)
                times[name].append((time.perf_counter() - start) / 20 * 1e6)
            sync()
    finally:
        replace({})

    def quartiles(values: list[float]) -> dict[str, float]:
        q1, median, q3 = statistics.quantiles(values, n=4)
        return dict(us=round(median, 2), q1=round(q1, 2), q3=round(q3, 2))

    def added(name: str, before: str) -> list[float]:
        return [t - b for t, b in zip(times[name], times[before])]

    first, last = parts[0][0], parts[-1][0]
    result = {first: quartiles(times[first])}
    result.update({name: quartiles(added(name, before)) for name, *_, before in parts[1:]})
    result["the whole hook"] = quartiles(added(last, first))
    return result


def deferred_breakdown(builders, steps: Steps, fresh_steps: Steps | None = None,
                       number: int = 20000) -> dict[str, float]:
    """Where a deferred step without new rows spends the hook's time, line by line, in us (each
    piece alone, best of 5 runs of ``number`` calls), as the hook's wrapper of ``build``'s own
    parameters (or ``metadata_hook._guard_step``, the generic wrapper's) runs a build it defers, and what the step's first guarded op adds when it resolves every group's deferred
    build (``handoff.resolve_deferred``; a replayed FULL graph's step runs no guarded op and skips
    it); with ``fresh_steps``, the same resolution of a step with a new row and its zeroing
    (``_deferred_fresh_lines``). Empty where the builders do not defer (not the op guard's groups on the CUDA path in an
    engine that captures FULL graphs: ``--cuda-path-on-cpu`` or CUDA)."""
    import timeit

    from gdn_pass.vllm import handoff, metadata_hook

    states = [metadata_hook.state_of(b) for b in builders]
    if any(state.deferred is None for state in states):
        return {}
    builder, state = builders[-1], states[-1]
    plain = type(builder).build.__wrapped__
    calls, metadata, defer_all, defer_and_resolve = _deferred_step(builders, states, plain, steps)
    kwargs, last = calls[-1], metadata[-1]

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    hooked = type(builder).build
    spent = {
        "the hook's wrapper of build's own parameters, a deferred build, minus vLLM's build": best(
            lambda: hooked(builder, **kwargs)) - best(lambda: plain(builder, **kwargs)),
        "_guard_step, a deferred build (the generic wrapper's path, for comparison)": best(
            lambda: metadata_hook._guard_step(builder, state, plain, (), kwargs, last)),
        "  max_query_len <= 1 (a decode step)": best(lambda: kwargs.get("common_attn_metadata").max_query_len <= 1),
        "  captured_staged_rows()": best(handoff.captured_staged_rows),
        "  the group's caches unchanged (identity)": best(
            lambda: getattr(state.forward_context.get(state.first_name), "kv_cache", None) is state.first_kv_cache),
        "  setattr of the build's inputs": best(lambda: setattr(last, metadata_hook._BUILD_INPUTS, ((), kwargs))),
        "  defer: weak reference, note, attach": best(lambda: handoff.defer(last, state.deferred)),
        f"the step's first guarded op: resolve_deferred, {len(builders)} groups, no new row":
            best(defer_and_resolve) - best(defer_all),
    }
    if fresh_steps is not None:
        spent.update(_deferred_fresh_lines(builders, states, plain, fresh_steps, best))
    return {name: round(us, 2) for name, us in spent.items()}


def _deferred_step(builders, states, plain, steps: Steps):
    """One step of ``steps`` built by vLLM for every builder: its calls, its metadata, and two
    timeable functions, ``defer_all`` (each build deferred, the step's check made again as for a new
    step) and ``defer_and_resolve`` (then the step's first guarded op's resolution, its hand-off
    returned)."""
    from gdn_pass.vllm import handoff, metadata_hook, rows

    base = steps.common()
    calls = [dict(common_prefix_len=0, common_attn_metadata=copy.copy(base)) for _ in builders]
    metadata = [plain(b, **kwargs) for b, kwargs in zip(builders, calls)]

    def defer_all():
        rows._last_idle_key[0] = None
        for b, s, c, m in zip(builders, states, calls, metadata):
            metadata_hook._guard_step(b, s, plain, (), c, m)

    def defer_and_resolve():
        defer_all()
        return handoff.resolve_deferred(metadata[0])

    return calls, metadata, defer_all, defer_and_resolve


def _deferred_fresh_lines(builders, states, plain, steps: Steps, best) -> dict[str, float]:
    """The same for a deferred step with a new row: what the step's first guarded op adds resolving
    every group's deferred build (the step's rows, each group's count and hand-off, the joint), and
    then what its zeroing adds (``JointZeroing.zero``: on CUDA the one launch for every group, on
    ``--cuda-path-on-cpu`` the launch counted, not run)."""
    _, _, defer_all, defer_and_resolve = _deferred_step(builders, states, plain, steps)

    def defer_resolve_and_zero():
        joint = defer_and_resolve().joint
        if joint is None:
            raise RuntimeError("a deferred step with a new row joined no joint zeroing")
        joint.zero()

    resolved = best(defer_and_resolve)
    n = len(builders)
    return {
        f"the step's first guarded op: resolve_deferred, {n} groups, one new row": resolved - best(defer_all),
        f"  then the joint zeroing of the {n} groups (one launch)": best(defer_resolve_and_zero) - resolved,
    }


def fresh_breakdown(builders, steps: Steps, number: int = 5000) -> dict[str, float]:
    """Where a step with a fresh row spends the hook's time at build, line by line, in us: each
    piece timed alone (best of 5 runs of ``number`` calls) on a later build of the step (its rows
    found by identity), as ``metadata_hook._stage_step`` runs it; no zeroing launch (that comes in
    the forward, ``--forward``). On CUDA the entry hands the launch vLLM's decode rows and stages
    nothing; on CPU (no cache table) it stages the rows to zero."""
    import timeit

    from gdn_pass.vllm import compat, handoff, metadata_hook, rows

    builder = builders[-1]
    state = metadata_hook.state_of(builder)
    plain = type(builder).build.__wrapped__
    common = steps.common()
    kwargs = dict(common_prefix_len=0, common_attn_metadata=common)
    metadata = plain(builder, **kwargs)
    entry, staged = state.entry, state.rows
    on_device = state.table is not None
    draft = compat.step_inputs(plain, builder, (), kwargs)[1]

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    def first_rows():
        rows._last_step[0] = None
        rows._last_idle_key[0] = None
        rows.scheduler_rows(common)

    def fresh_path():  # a joint of its own each time, as each step starts one
        metadata_hook._guard_step(builder, state, plain, (), kwargs, metadata)
        handoff._joining[0] = lambda: None

    def joined():
        handoff._joining[0] = lambda: None
        handoff.join(step, handoff.StepHandoff(staged, 1, state.table, None, False))

    rows.has_new_rows(common)
    step = rows.scheduler_rows(common)
    host = entry.rows(common, metadata, draft)
    spent = {
        "_guard_step, the whole fresh path (a later build)": best(fresh_path),
        "  has_new_rows (step found by identity)": best(lambda: rows.has_new_rows(common)),
        "  the step's scheduler rows, computed (its first build only)": best(first_rows),
        "  compat.step_inputs": best(lambda: compat.step_inputs(plain, builder, (), kwargs)),
        "  _group_state (caches unchanged)": best(lambda: metadata_hook._group_state(state)),
        "  entry.stage_step, whole": best(
            lambda: entry.stage_step(staged, common, metadata, draft, on_device=on_device)),
        "    entry.rows (the builder's host rows, its fresh count)": best(
            lambda: entry.rows(common, metadata, draft)),
    }
    rows.scheduler_rows(common)
    if on_device:
        spent["    entry.decode_rows (vLLM's device decode rows)"] = best(
            lambda: entry.decode_rows(common, metadata, staged.max_rows))
    else:
        spent["    stage_fresh (flags copy and slots copy)"] = best(lambda: host.stage_fresh(staged))
    spent.update({
        "  StepHandoff(...)": best(lambda: handoff.StepHandoff(staged, 1, state.table, None, False)),
        "  join (a new step's joint)": best(joined),
        "  attach": best(lambda: handoff.attach(metadata, state.idle)),
    })
    handoff._joining[0] = lambda: None
    rows.has_new_rows(common)
    return {name: round(us, 2) for name, us in spent.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--builder", choices=("gdn", "bailing"), default="gdn",
                    help="gdn: Qwen3-Next's GDN builders; bailing: Bailing-MoE-v2.5's Lightning builders. "
                         "Both behind guarded ops (the op guard owns them) unless --step-guard")
    ap.add_argument("--step-guard", action="store_true",
                    help="the layers behind no guarded op, as in an eager engine: the step guard owns the "
                         "groups and zeroes at build")
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--layers-per-group", type=int, default=12)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--padded-batches", nargs="*", default=["5:8", "40:64"], metavar="REAL:PADDED",
                    help="steps without new rows whose real rows are padded to a FULL graph's size")
    ap.add_argument("--repeat", type=int, default=400)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each line of the hook's path alone: the short path of a step without "
                         "new rows, a deferred build's path and its resolve (where builds are deferred), and "
                         "the build-time path of a step with one fresh row")
    ap.add_argument("--in-context", action="store_true",
                    help="also time each part of the hook inside real steps without new rows (each B of "
                         "--batches): the builds with one more part of the hook each, interleaved round by round")
    ap.add_argument("--forward", action="store_true",
                    help="with the hook, also run every layer's guarded op (the op guard) each step, as a "
                         "compiled engine's piecewise forward does: a step with fresh rows makes its zeroing "
                         "launches there")
    ap.add_argument("--cuda-path-on-cpu", action="store_true",
                    help="CPU only: the builds take the guards' CUDA path (a cache table of the CPU caches, as "
                         "tests/vllm/cuda_zeroing.py makes it: vLLM's decode rows handed on, nothing staged) in an "
                         "engine that captures FULL CUDA graphs; builds only, as a replayed FULL graph's step, or with "
                         "--forward the guarded ops too, their launches counted, not run (they would run in "
                         "Triton's interpreter)")
    ap.add_argument("--inference-host-tensors", action="store_true",
                    help="host tensors made under torch.inference_mode, as vLLM 0.34's V2 runner makes them")
    args = ap.parse_args()
    if args.forward and args.step_guard:
        ap.error("--forward runs the guarded ops, which --step-guard leaves out (the step guard zeroes at build)")
    cuda = torch.cuda.is_available()
    if args.cuda_path_on_cpu:
        if cuda:
            ap.error("--cuda-path-on-cpu is for a CPU-only machine")
        if args.step_guard:
            ap.error("--cuda-path-on-cpu times deferred builds; the step guard launches its zeroing at "
                     "build, which cannot run on a CPU: run without it")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
        import cuda_zeroing

        from gdn_pass.vllm import metadata_hook

        metadata_hook._cache_table = lambda caches, device: cuda_zeroing.cpu_table(caches) if caches else None
        if args.forward:  # the launches would run in Triton's interpreter: counted, not run
            from gdn_pass.kernels.zero_rows import MAX_GROUPS
            from gdn_pass.vllm import handoff

            handoff.zero_new_rows_groups = lambda tables, *rest: -(-len(tables) // MAX_GROUPS)
            handoff.StepHandoff.zero = lambda self, caches, *, whole_table: 1 if whole_table else len(caches)
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    padded = [tuple(int(n) for n in p.split(":")) for p in args.padded_batches]
    builders = make_builders(device, max([*args.batches, *(p for _, p in padded)]) + 2, args.groups,
                             args.layers_per_group, args.builder, full_graphs_on_cpu=args.cuda_path_on_cpu,
                             guarded=not args.step_guard)
    forward = Forward(builders, "gdn" if args.builder == "gdn" else "lightning") if args.forward else None
    rows = []
    cases = [(batch, fresh, None) for batch in args.batches for fresh in sorted({0, 1, batch // 2})]
    cases += [(real, 0, padded_to) for real, padded_to in padded]
    for batch, fresh, padded_to in cases:
        steps = Steps(batch, fresh, device, padded_to, inference=args.inference_host_tensors)
        for _ in range(50):  # warm-up: caches, allocator, the owner's decision
            build_step(builders, steps, True, forward)
        sync()
        with_hook, alone = time_steps(builders, steps, args.repeat, sync, forward)
        row = dict(batch=batch, fresh=fresh, vllm_us=round(alone, 1), hook_us=round(with_hook - alone, 1))
        if padded_to:
            row["padded_to"] = padded_to
        if cuda and fresh:
            row["busy_us"] = round(busy_step_us(builders, steps, forward), 1)
        if forward is not None:
            row.update(step_activity(builders, steps, forward))
        if not fresh:
            first_us, later_us = split_idle_us(builders, steps, args.repeat, sync)
            row.update(first_build_us=round(first_us, 1), later_build_us=round(later_us, 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    breakdown, fresh_lines, deferred_lines, context = {}, {}, {}, {}
    if args.in_context:
        for batch in args.batches:
            context[str(batch)] = in_context(builders, Steps(batch, 0, device, inference=args.inference_host_tensors),
                                             args.repeat, sync)
            print(json.dumps({f"in_context_B{batch}": context[str(batch)]}), flush=True)
    if args.breakdown:
        idle_steps = Steps(max(args.batches), 0, device, inference=args.inference_host_tensors)
        breakdown = idle_breakdown(builders, idle_steps)
        print(json.dumps(breakdown, indent=1), flush=True)
        deferred_lines = deferred_breakdown(builders, idle_steps,
                                            Steps(8, 1, device, inference=args.inference_host_tensors))
        print(json.dumps(deferred_lines, indent=1), flush=True)
        fresh_lines = fresh_breakdown(builders, Steps(8, 1, device, inference=args.inference_host_tensors))
        print(json.dumps(fresh_lines, indent=1), flush=True)
    import vllm

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = dict(command="python benchmarks/hook_host_time.py " + " ".join(sys.argv[1:]), commit=commit,
                  builder=args.builder, groups=args.groups, layers_per_group=args.layers_per_group,
                  inference_host_tensors=args.inference_host_tensors, forward=args.forward,
                  cuda_path_on_cpu=args.cuda_path_on_cpu, step_guard=args.step_guard,
                  device=torch.cuda.get_device_name() if cuda else "cpu", vllm=vllm.__version__,
                  torch=torch.__version__, rows=rows, idle_breakdown_us=breakdown,
                  deferred_breakdown_us=deferred_lines, fresh_breakdown_us=fresh_lines, in_context_us=context)
    table = [f"{args.groups} {'GDN' if args.builder == 'gdn' else 'Bailing (Lightning)'} builders x "
             f"{args.layers_per_group} layers per step, {result['device']}, "
             f"vLLM {vllm.__version__}, commit {commit}"
             + (", host tensors made under inference mode (vLLM 0.34's V2 runner)" if args.inference_host_tensors
                else "")
             + (", hook us/step with every layer's guarded op (the op guard's launches)" if args.forward else "")
             + (", the step guard's groups (no guarded op)" if args.step_guard else "")
             + (", the guards' CUDA path on CPU (a cache table of the CPU caches)" if args.cuda_path_on_cpu else ""),
             "",
             "| B | fresh | vLLM builds us/step | hook us/step | of it: first build / each later build, us "
             "| one step behind 2 ms of GPU work, us |" + (" deferred, zeroing launches (one step) |" if forward else ""),
             "|---|---|---|---|---|---|" + ("---|" if forward else "")]
    table += [f"| {r['batch']}{' -> ' + str(r['padded_to']) if 'padded_to' in r else ''} | {r['fresh']} | {r['vllm_us']} | {r['hook_us']} | "
              + (f"{r['first_build_us']} / {r['later_build_us']}" if "first_build_us" in r else "")
              + f" | {r.get('busy_us', '')} |"
              + (f" {'yes' if r['deferred'] else 'no'}, {r['launches']} |" if forward else "") for r in rows]
    if context:
        parts = list(next(iter(context.values())))
        table += ["", "Inside real steps without new rows: what each part adds to the step (median over "
                  f"{args.repeat} rounds of 20 steps, quartiles in brackets), us a step of {len(builders)} builds:", "",
                  "| part | " + " | ".join(f"B = {b}" for b in context) + " |",
                  "|---|" + "---|" * len(context)]
        table += [f"| {part} | " + " | ".join(f"{c[part]['us']} ({c[part]['q1']} to {c[part]['q3']})"
                                              for c in context.values()) + " |" for part in parts]
    if breakdown:
        table += ["", f"A step without new rows (B = {max(args.batches)}), each line alone, us:", "",
                  "| line | us |", "|---|---|"] + [f"| {name.strip()} | {us} |" for name, us in breakdown.items()]
    if deferred_lines:
        table += ["", f"A deferred step without new rows (B = {max(args.batches)}; the last two lines: with one "
                  "new row, B = 8), each line alone, us (a replayed FULL graph's step pays the builds' lines only):", "",
                  "| line | us |", "|---|---|"] + [f"| {name.strip()} | {us} |" for name, us in deferred_lines.items()]
    if fresh_lines:
        table += ["", "A step with one fresh row (B = 8), a later build, each line alone, us "
                  f"({'vLLM decode rows, nothing staged' if any('decode_rows' in k for k in fresh_lines) else 'no cache table: rows staged'}):", "",
                  "| line | us |", "|---|---|"] + [f"| {name.strip()} | {us} |" for name, us in fresh_lines.items()]
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hook_host_time.json").write_text(json.dumps(result, indent=1))
        (args.out / "hook_host_time.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
