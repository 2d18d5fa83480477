"""What each engine step scheduled and how it ran, recorded inside vLLM's workers.

The GDN builder and the model runner live in the worker processes: in the
engine's own process with one GPU, in one process per rank with tensor
parallelism. ``StepTrace`` is given to vLLM as
``worker_extension_cls="harness.step_trace.StepTrace"``; vLLM mixes
it into every worker, and the driver asks each rank through
``llm.collective_rpc``:

    llm.collective_rpc("gdn_trace_start")      # after start-up: capture builds are not steps
    ...engine steps...
    llm.collective_rpc("gdn_trace_summary")    # one dict per rank

Per step it records the rows of one recurrent-state builder (the first of
the registry's builders, ``gdn_pass.vllm.builders``, to build a step: every
group sees the same requests) and, where the runner has it, the CUDA-graph dispatch of that
step (mode, real and padded token counts). ``gdn_zero_caches`` zeroes the
worker's caches, which is how the fuzz's reference engine starts each prompt
from a fresh engine's state. Test instrumentation only: the plugin itself
never installs it.

``GDN_FUZZ_MUTATION`` in the environment changes the guard on purpose in
every worker that loads this extension, for diagnostic runs (or, for
``harness_zeroing``, fixes the bug without gdn-pass):

    skip_zeroing            the pass rewrites and stages, but no zeroing kernel
                            runs: the guard is broken (what its presence alone
                            changes, and proof that the fuzz catches a broken guard)
    zeroing_without_writes  the zeroing kernels run with every row marked not
                            fresh: the same launches, no write (what the writes
                            change, apart from the launches)
    harness_zeroing         (pass off) the harness zeroes each fresh decode row's
                            slot itself after the build: the fix's effect without
                            gdn-pass, the reference for the pass's footprint
    nudge_live_rows         (CPU) each zeroing also scales the live rows' state by
                            1 + 2**-6: a footprint outside the rows the guard acts
                            on, which the fuzz's footprint check must catch
    zeroed_at_start         no change to the guard: the harness zeroes every cache
                            once the engine has started, before the stream (what
                            the caches held before the stream changes)
    chunk_rows_one_slot     (Lightning, MTP) a row of prompt tokens (no draft tokens,
                            more than one token) that the builder put on its
                            speculative decode path gets its row's column-0 slot in
                            every column: the kernel then reads and leaves the
                            state in the slot the next step reads (issue 44's probe)
"""

from __future__ import annotations

import functools
import os
from collections import Counter

__all__ = ["StepTrace", "row_kinds", "row_paths", "metadata_row_paths", "fill_caches", "slot_reading_fresh_rows"]

_ACTIVE: dict = {}


def row_paths(spec_rows: list[bool], num_decodes: int) -> list[str]:
    """Each row's kernel path as the GDN builder split the batch: "spec", "decode" or "prefill".

    Speculative rows are those of vLLM's mask; of the other rows, in batch
    order, the first ``num_decodes`` are decodes (vLLM orders a batch decodes
    first, then short extends, then prefills, and its split counts every
    leading row of at most one token as a decode: a brand-new one-token row
    among them is a decode even in a step with prefills).
    """
    paths, non_spec = [], 0
    for is_spec in spec_rows:
        if is_spec:
            paths.append("spec")
            continue
        paths.append("decode" if non_spec < num_decodes else "prefill")
        non_spec += 1
    return paths


def metadata_row_paths(md, num_reqs: int) -> list[str]:
    """Each row's kernel path, read from one builder's metadata (GDN's or Lightning's).

    GDN metadata marks speculative rows by ``spec_sequence_masks`` (``row_paths``).
    The Lightning builders (``linear_attn``) put their decodes first: the first
    ``num_decodes`` rows run the decode kernel, or the speculative decode kernel
    where ``state_indices_tensor_d`` has a slot column per draft token, and
    the rest the prefill kernel.
    """
    if hasattr(md, "spec_sequence_masks"):
        mask = md.spec_sequence_masks
        spec_rows = [False] * num_reqs if mask is None else [bool(x) for x in mask[:num_reqs].cpu().tolist()]
        return row_paths(spec_rows, md.num_decodes)
    slots_d = getattr(md, "state_indices_tensor_d", None)
    decode = "spec" if slots_d is not None and slots_d.dim() == 2 else "decode"
    decodes = min(int(md.num_decodes), num_reqs)
    return [decode] * decodes + ["prefill"] * (num_reqs - decodes)


def _spec_detail(md) -> dict:
    """A speculative step's slot columns and accepted counts per speculative row (Lightning's
    and GDN's fields), if any."""
    out = {}
    for field, name in (("state_indices_tensor_d", "slots_d"), ("spec_state_indices_tensor", "spec_slots"),
                        ("num_accepted_tokens", "num_accepted")):
        value = getattr(md, field, None)
        if hasattr(value, "tolist"):
            out[name] = value.tolist()
    return out


def _state_slots(md):
    """The per-row state slots of a non-speculative step (GDN's or Lightning's field name)."""
    if hasattr(md, "non_spec_state_indices_tensor"):
        return md.non_spec_state_indices_tensor
    return getattr(md, "state_indices_tensor", None)


def row_kinds(query_lens, num_computed_tokens, paths: list[str]) -> Counter:
    """Counts of this step's row kinds, from vLLM's own fields and ``row_paths``.

    ``fresh_decode`` is the bug's trigger: a brand-new row that the builder
    put on a decode (or speculative decode) path, whose kernels read its
    recycled slot. ``spec`` counts speculative rows, which are counted by
    their other kind too.
    """
    kinds: Counter = Counter(spec=0)
    for computed, q, path in zip(num_computed_tokens, query_lens, paths):
        if q <= 0:
            continue  # padding
        kinds["spec"] += path == "spec"
        if computed == 0:
            kinds["fresh_prefill" if path == "prefill" else "fresh_decode"] += 1
        elif q > 1 and path == "prefill":
            kinds["continuation"] += 1  # a chunk of a prompt (or a prefix-hit remainder)
        else:
            kinds["decode"] += 1
    return kinds


def slot_reading_fresh_rows(ids: list, num_computed_tokens: list[int], query_lens: list[int],
                            paths: list[str]) -> dict[str, str]:
    """The requests of a step's rows that are fresh (nothing computed, tokens to run) on a path
    whose kernels read their slot (not ``"prefill"``): the rows a guard acts on -> their path."""
    return {rid: path for rid, c, q, path in zip(ids, num_computed_tokens, query_lens, paths)
            if c == 0 and q > 0 and path != "prefill"}


def spec_prompt_rows(ids: list, query_lens: list[int], paths: list[str], draft_counts) -> dict[str, str]:
    """The requests of a step's rows that run more than one prompt token on the speculative path
    (no draft tokens: ``draft_counts`` -1, or None where no row of the step has any): the rows
    ``gdn_pass.vllm.prompt_chunks`` repairs -> "spec"."""
    drafts = [-1] * len(ids) if draft_counts is None else [int(x) for x in draft_counts[: len(ids)]]
    return {rid: path for rid, q, path, d in zip(ids, query_lens, paths, drafts)
            if path == "spec" and q > 1 and d < 0}


def compare_with_hook(state: dict, m, md, ids: list, qlens, computed, trace_fresh: int) -> None:
    """Compare the plugin hook's count of rows to zero with this trace's count of fresh rows.

    The hook hands its guards the count from its host view of the step
    (``handoff.host_fresh``: the scheduler's host lengths); the trace counts the
    fresh rows on a path that reads their slot from vLLM's device lengths
    (``row_kinds``). Where the hook attached a hand-off (pass on, and the hook
    inside this trace's wrapper), one more step is compared, and the first 20
    steps where the counts differ keep their rows (``hook_disagreements``):
    which requests, their lengths as each side saw them, and vLLM's split.
    """
    from gdn_pass.vllm import rows
    from gdn_pass.vllm.handoff import ATTR

    handoff = getattr(md, ATTR, None)
    if handoff is not None and handoff.resolve is not None:
        # A deferred build: its rows are made by the step's first guarded op, or never (a replayed
        # FULL graph's step). Asking for them here would make them at build, the path it skips.
        state["hook_deferred"] = state.get("hook_deferred", 0) + 1
        return
    if handoff is None or handoff.host_fresh is None:
        return  # pass off, or the hook wraps this trace and attaches later
    slots_d = getattr(md, "state_indices_tensor_d", None)
    width = slots_d.shape[1] if slots_d is not None and slots_d.dim() == 2 else 1
    hook_fresh = handoff.host_fresh // width  # the Lightning hook counts each slot column
    state["hook_compared"] = state.get("hook_compared", 0) + 1
    disagreements = state.setdefault("hook_disagreements", [])
    if hook_fresh == trace_fresh or len(disagreements) >= 20:
        return
    n = m.num_reqs
    host = rows.num_computed_tokens(m, qlens.numpy(), rows.host_lengths(m))
    accepted = getattr(md, "num_accepted_tokens", None)
    disagreements.append(dict(
        step=len(state.get("steps", ())) - 1, hook_fresh=hook_fresh, trace_fresh=trace_fresh,
        req_ids=list(ids[:n]), query_lens=qlens.tolist(), computed_device=computed.tolist(),
        computed_host=[int(x) for x in host[:n]], num_decodes=int(md.num_decodes),
        num_prefills=int(md.num_prefills), num_accepted=None if accepted is None else accepted[:n].cpu().tolist()))


def fill_caches(vllm_config, value: float) -> int:
    """Set every layer's KV / conv / recurrent cache of this worker to ``value``; the count of tensors."""
    import torch

    filled = [0]

    def fill(x):
        if isinstance(x, torch.Tensor):
            x.fill_(value)
            filled[0] += 1
        elif isinstance(x, (list, tuple)):
            for item in x:
                fill(item)

    for layer in vllm_config.compilation_config.static_forward_context.values():
        fill(getattr(layer, "kv_cache", None))
    return filled[0]


def _step_req_ids(state: dict) -> list:
    """The request ids of the step being built, in batch order (V1: the runner's persistent
    input batch; V2: the ids its ``prepare_inputs`` was given this step)."""
    if "v2_req_ids" in state:
        return state["v2_req_ids"]
    return list(getattr(getattr(state["runner"], "input_batch", None), "req_ids", []))


class StepTrace:
    """Worker extension: methods vLLM adds to each worker (see module docstring)."""

    def gdn_trace_start(self, detail: bool = False) -> bool:
        """Start recording; ``detail`` also keeps each step's rows by request id."""
        from gdn_pass.vllm import accepted_counts, compat, draftless_steps

        state = _ACTIVE.setdefault("state", dict(steps=[], dispatch=None, builder=None))
        state["steps"].clear()
        state["detail"] = detail
        state["one_token_paths"] = {}
        state["fresh_reads"] = {}
        state["fresh_reads_other_builders"] = {}
        state["spec_prompt_rows"] = {}
        state["counts_supplied_rows"] = {}
        state["full_graph_prefill_rows"] = {}
        state["kept_off_full_graph_rows"] = {}
        state["schedule"] = {}
        state["hook_compared"] = 0
        state["hook_deferred"] = 0
        state["hook_disagreements"] = []
        state["runner"] = getattr(self, "model_runner", None)
        if _ACTIVE.get("installed"):
            return True
        from gdn_pass.vllm import builders

        def hook(builder_class) -> None:
            original_build = builder_class.build

            @functools.wraps(original_build)
            def build(builder, *args, **kwargs):
                # A subclass's build may call its base's: record the outermost call only.
                outermost = not state.get("in_build")
                state["in_build"] = True
                try:
                    md = original_build(builder, *args, **kwargs)
                finally:
                    state["in_build"] = not outermost
                if outermost:
                    record(builder, original_build, args, kwargs, md)
                return md

            builder_class.build = build

        def record(builder, original_build, args, kwargs, md) -> None:
            if state["builder"] is None:
                state["builder"] = id(builder)
            m, draft_counts = compat.step_inputs(original_build, builder, args, kwargs)
            qlens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1])[: m.num_reqs]
            computed = m.compute_num_computed_tokens()[: m.num_reqs].cpu()
            paths = metadata_row_paths(md, m.num_reqs)
            if id(builder) != state["builder"]:
                # Another builder: another KV-cache group of the model (the same rows) or an MTP
                # drafter's (rows of its own). A guard acts on its fresh rows too.
                ids = _step_req_ids(state)
                state["fresh_reads_other_builders"].update(
                    slot_reading_fresh_rows(ids, computed.tolist(), qlens.tolist(), paths))
                return
            slots = _state_slots(md)
            state["steps"].append(dict(
                rows=row_kinds(qlens.tolist(), computed.tolist(), paths),
                real_rows=int((qlens > 0).sum()),
                slot_rows=None if slots is None else int(slots.shape[0]),
                dispatch=state["dispatch"]))
            ids = _step_req_ids(state)
            # Each request's steps as the batch around it looked: where a fix changes the schedule
            # (MTP: a repaired request accepts other drafts, so the batches after it differ), a
            # request's numerics may move with the batch it ran in (fuzz_judge.schedule_moved).
            total, real = int(qlens.sum()), int((qlens > 0).sum())
            mode = None if state["dispatch"] is None else state["dispatch"]["mode"]
            for rid, c, q in zip(ids, computed.tolist(), qlens.tolist()):
                if q > 0:
                    state["schedule"].setdefault(rid, []).append((c, q, total, real, mode))
            # The kernel path of each fresh one-token row (the last time it was fresh: a
            # request preempted before its first token is fresh again when resumed).
            # ``one_token_paths`` says whether the step had prefills (the kernels, hence the
            # numerics, of the fuzz's reference); ``fresh_reads`` which fresh rows the
            # builder put on a path that reads their slot (the rows a guard acts on).
            for rid, c, q in zip(ids, computed.tolist(), qlens.tolist()):
                if c == 0 and q == 1:
                    state["one_token_paths"][rid] = "prefill" if md.num_prefills > 0 else "decode"
            state["fresh_reads"].update(slot_reading_fresh_rows(ids, computed.tolist(), qlens.tolist(), paths))
            state["spec_prompt_rows"].update(spec_prompt_rows(ids, qlens.tolist(), paths, draft_counts))
            if accepted_counts.supplies(builder):
                # the V2 runner's accepted counts, passed by gdn-pass: its speculative path instead
                # of the prefill path (gdn_pass.vllm.accepted_counts). Where vLLM passes the builder
                # counts itself (GDN's), only a padded new request's row is gdn-pass's doing.
                supplied = range(len(ids))
                if _vllm_passes_counts(builder):
                    padded = accepted_counts._Step.padded_drafts  # the step's, set in prepare_attn
                    supplied = [] if padded is None else [i for i, d in enumerate(padded.tolist()) if d >= 0]
                state["counts_supplied_rows"].update(
                    {ids[i]: paths[i] for i in supplied if i < len(ids) and paths[i] == "spec" and qlens[i] > 0})
            dispatch = state["dispatch"]
            if dispatch is not None and dispatch.get("kept_off_full"):
                # rows of a step gdn-pass kept off the speculative FULL graph (draftless_steps)
                state["kept_off_full_graph_rows"].update(
                    {rid: dispatch["mode"] for rid, q in zip(ids, qlens.tolist()) if q > 0})
            if dispatch is not None and dispatch["mode"] == "FULL" and md.num_prefills > 0:
                # the runner replays a FULL decode graph on a step its builder split with prefills:
                # the graph reads decode buffers this build did not stage (prompt_chunks)
                state["full_graph_prefill_rows"].update(
                    {rid: "prefill" for rid, q in zip(ids, qlens.tolist()) if q > 0})
            compare_with_hook(state, m, md, ids, qlens, computed, state["steps"][-1]["rows"]["fresh_decode"])
            if state["detail"]:
                all_slots = [] if slots is None else slots.tolist()
                state["steps"][-1]["detail"] = dict(
                    req_ids=ids[: m.num_reqs], query_lens=qlens.tolist(), computed=computed.tolist(),
                    slots=all_slots, num_decodes=md.num_decodes, num_prefills=md.num_prefills,
                    paths=paths, dispatch=state["dispatch"], **_spec_detail(md))
            state["dispatch"] = None

        # Every registered builder this vLLM has (a subclass with an entry of its own
        # is hooked where it defines ``build``); the first to build a step is traced.
        for _entry, builder_class in builders.installed():
            if "build" in vars(builder_class):
                hook(builder_class)
        runner = getattr(self, "model_runner", None)
        decide = getattr(runner, "_determine_batch_execution_and_padding", None)
        if decide is not None:
            @functools.wraps(decide)
            def determine(*args, **kwargs):
                kept_before = draftless_steps.activity()["steps"]
                out = decide(*args, **kwargs)
                if kwargs.get("force_uniform_decode") is None:  # not a capture / dummy run
                    mode, desc = out[0], out[1]
                    state["dispatch"] = dict(mode=getattr(mode, "name", str(mode)),
                                             tokens=int(kwargs.get("num_tokens", args[0] if args else 0)),
                                             padded_tokens=int(desc.num_tokens),
                                             # gdn-pass kept this step off the speculative FULL graph
                                             kept_off_full=draftless_steps.activity()["steps"] > kept_before)
                return out

            runner._determine_batch_execution_and_padding = determine
        prepare = getattr(runner, "prepare_inputs", None)
        if decide is None and prepare is not None and hasattr(runner, "req_states"):
            # vLLM's V2 model runner (0.34's only one) makes a new input batch per step: its
            # request ids and CUDA-graph choice are read where it prepares the step's inputs.
            @functools.wraps(prepare)
            def prepare_inputs(scheduler_output, batch_req_state, batch_desc, *args, **kwargs):
                state["v2_req_ids"] = list(batch_req_state.req_ids)
                mode = batch_desc.cg_mode
                state["dispatch"] = dict(mode=getattr(mode, "name", str(mode)),
                                         tokens=int(batch_req_state.num_tokens),
                                         padded_tokens=int(max(batch_desc.num_tokens, batch_req_state.num_tokens)))
                return prepare(scheduler_output, batch_req_state, batch_desc, *args, **kwargs)

            runner.prepare_inputs = prepare_inputs
        _ACTIVE["installed"] = True
        return True

    def gdn_zero_caches(self) -> int:
        """Zero every layer's KV / conv / recurrent cache in this worker: a fresh engine's state.

        The caches live in the workers (one process per rank under tensor
        parallelism), so zeroing must run here, not in the driver. Returns
        the number of tensors zeroed.
        """
        return fill_caches(self.vllm_config, 0.0)

    def gdn_trace_details(self) -> list[dict]:
        return [s.get("detail") for s in _ACTIVE.get("state", {}).get("steps", [])]

    def gdn_trace_summary(self) -> dict:
        state = _ACTIVE.get("state", {})
        steps = state.get("steps", [])
        rows: Counter = Counter()
        modes: Counter = Counter()
        fresh_decode = padded_graph = fresh_in_padded_full = 0
        for s in steps:
            rows.update(s["rows"])
            d = s["dispatch"]
            padded = d is not None and d["mode"] != "NONE" and d["padded_tokens"] > d["tokens"]
            if d is not None:
                modes[d["mode"]] += 1
            padded_graph += padded
            fresh_decode += s["rows"]["fresh_decode"] > 0
            fresh_in_padded_full += (s["rows"]["fresh_decode"] > 0 and padded
                                     and d["mode"] == "FULL")
        from gdn_pass.vllm import draftless_steps, metadata_hook, step_guard

        # whether this worker's process has the plugin's hook (entry point) and who guarded
        plugin = dict(hook_installed=metadata_hook.is_installed(), **step_guard.activity(),
                      steps_kept_off_full_graph=draftless_steps.activity()["steps"],
                      # steps of engines where it applies: 0 where the runner was not found
                      steps_checked_for_draftless_rows=draftless_steps.activity()["checked"])
        return dict(steps=len(steps), rows=dict(rows), cudagraph_modes=dict(modes), plugin=plugin,
                    fresh_decode_steps=fresh_decode, padded_graph_steps=padded_graph,
                    fresh_decode_in_padded_full_graph=fresh_in_padded_full,
                    one_token_paths=dict(state.get("one_token_paths", {})),
                    fresh_reads=dict(state.get("fresh_reads", {})),
                    # the same from the step's other builders (other groups, an MTP drafter's)
                    fresh_reads_other_builders=dict(state.get("fresh_reads_other_builders", {})),
                    # rows of prompt tokens the builder ran on its speculative path
                    spec_prompt_rows=dict(state.get("spec_prompt_rows", {})),
                    # rows on the speculative path because gdn-pass passed the V2 runner's counts
                    counts_supplied_rows=dict(state.get("counts_supplied_rows", {})),
                    # rows of steps whose FULL decode graph replayed on a build with prefills
                    full_graph_prefill_rows=dict(state.get("full_graph_prefill_rows", {})),
                    # rows of steps gdn-pass kept off the speculative FULL graph (draftless_steps)
                    kept_off_full_graph_rows=dict(state.get("kept_off_full_graph_rows", {})),
                    # per request, each step it ran in: (computed before, its tokens, the step's
                    # tokens, the step's rows, the CUDA-graph mode)
                    schedule=dict(state.get("schedule", {})),
                    # the plugin hook's count of rows to zero against this trace's, per step
                    hook_compared_steps=state.get("hook_compared", 0),
                    # builds whose rows the hook deferred to the step's first guarded op: not compared
                    hook_deferred_builds=state.get("hook_deferred", 0),
                    hook_disagreements=list(state.get("hook_disagreements", [])),
                    spec_steps=sum(s["rows"]["spec"] > 0 for s in steps),
                    # rows the chunk_rows_one_slot mutation gave one slot (diagnostic runs only)
                    chunk_rows_one_slot=sum(_ACTIVE.get("chunk_rows_one_slot", ())))


def _vllm_passes_counts(builder) -> bool:
    """Does vLLM's own ``get_extra_attn_kwargs`` (unwrapped) give ``builder`` the accepted counts?
    The answer is the builder class's (vLLM's method tests the class): asked once per class."""
    cls = type(builder)
    if cls not in _VLLM_PASSES_COUNTS:
        import importlib

        from gdn_pass.vllm import accepted_counts

        module, name = accepted_counts.RUNNER_METADATA
        runner_metadata = getattr(importlib.import_module(module), name)
        method = runner_metadata.get_extra_attn_kwargs
        _VLLM_PASSES_COUNTS[cls] = accepted_counts._passes_counts(runner_metadata, builder,
                                                                  getattr(method, "__wrapped__", method))
    return _VLLM_PASSES_COUNTS[cls]


_VLLM_PASSES_COUNTS: dict[type, bool] = {}


MUTATION_ENV = "GDN_FUZZ_MUTATION"


def _skip_zeroing() -> None:
    from gdn_pass.vllm import handoff  # both guards zero through StepHandoff.zero

    def no_write(*args, **kwargs):
        return None

    # zero_new_rows_all: CUDA steps whose fresh rows are found in vLLM's device tensors
    handoff.zero_rows = handoff.zero_rows_all = handoff.zero_new_rows_all = no_write


def _zeroing_without_writes() -> None:
    import torch

    from gdn_pass.vllm import handoff

    def without_writes(zero):
        @functools.wraps(zero)
        def launch(cache_or_table, slot, fresh):
            return zero(cache_or_table, slot, torch.zeros_like(fresh))

        return launch

    handoff.zero_rows = without_writes(handoff.zero_rows)
    handoff.zero_rows_all = without_writes(handoff.zero_rows_all)

    # CUDA steps whose fresh rows are found on the device (query_len == seq_len): the
    # same launch with every seq_len one longer finds none.
    def without_new_rows(zero_new):
        @functools.wraps(zero_new)
        def launch_new(table, slot, query_start_loc, seq_lens, num_rows, max_rows):
            return zero_new(table, slot, query_start_loc, seq_lens + 1, num_rows, max_rows)

        return launch_new

    handoff.zero_new_rows_all = without_new_rows(handoff.zero_new_rows_all)


def _nudge_live_rows() -> None:
    """Each CPU zeroing also scales the state of the rows it must leave alone by 1 + 2**-6:
    a guard whose footprint reaches live rows, too small to change most tokens."""
    from gdn_pass.vllm import handoff

    def nudging(zero):
        @functools.wraps(zero)
        def launch(cache, slot, fresh):
            zero(cache, slot, fresh)
            live = slot[~fresh & (slot >= 0)]
            cache[live] = cache[live] * (1 + 2 ** -6)

        return launch

    handoff.zero_rows = nudging(handoff.zero_rows)


def _harness_zeroing() -> None:
    """With the pass off: after every build of a registered builder, zero the slots
    of its fresh rows on a decode path in every state tensor of its layers, by plain
    indexing. What the fix must produce, reached without gdn-pass's hook, staging
    or guards: the fuzz's reference for the pass's footprint."""
    import torch

    from gdn_pass.vllm import builders, compat

    def zero_fresh_slots(builder, original_build, args, kwargs, md) -> None:
        m, _ = compat.step_inputs(original_build, builder, args, kwargs)
        qlens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1])[: m.num_reqs].tolist()
        computed = m.compute_num_computed_tokens()[: m.num_reqs].cpu().tolist()
        paths = metadata_row_paths(md, m.num_reqs)
        if "spec" in paths:
            raise NotImplementedError("harness_zeroing: speculative rows are not supported")
        # decodes first: row i of the builder's decodes reads slots[i]
        slots = _state_slots(md)
        fresh = [slots[i] for i, (c, q, path) in enumerate(zip(computed, qlens, paths))
                 if c == 0 and q > 0 and path == "decode"]
        if not fresh:
            return
        made = builder.__dict__.get("_harness_built_with")
        if made is None:
            raise NotImplementedError("harness_zeroing: a builder made before the mutation was applied")
        index = torch.stack(fresh).to(torch.long)
        index = index[index >= 0]
        names = made.layer_names
        context = made.vllm_config.compilation_config.static_forward_context
        for name in names:
            stack = [getattr(context[name], "kv_cache", None)]
            while stack:
                x = stack.pop()
                if isinstance(x, torch.Tensor) and x.numel():
                    x.index_fill_(0, index.to(x.device), 0)
                elif isinstance(x, (list, tuple)):
                    stack.extend(x)

    for _entry, builder_class in builders.installed():
        if "build" not in vars(builder_class):
            continue
        original_init = builder_class.__init__

        def init(builder, *args, _original=original_init, **kwargs):
            _original(builder, *args, **kwargs)
            # vLLM 0.26-0.29's GDN builder keeps no layer_names: take them from the call
            builder.__dict__["_harness_built_with"] = compat.builder_context(_original, builder, args, kwargs)

        builder_class.__init__ = functools.wraps(original_init)(init)
    _after_every_build(zero_fresh_slots)


def _after_every_build(act) -> None:
    """Wrap ``build`` of every registered builder class that defines one, so that
    ``act(builder, original_build, args, kwargs, metadata)`` runs after it."""
    from gdn_pass.vllm import builders

    for _entry, builder_class in builders.installed():
        if "build" not in vars(builder_class):
            continue
        original = builder_class.build

        def build(builder, *args, _original=original, **kwargs):
            md = _original(builder, *args, **kwargs)
            act(builder, _original, args, kwargs, md)
            return md

        builder_class.build = functools.wraps(original)(build)


def _chunk_rows_one_slot() -> None:
    """Lightning with MTP: after every build, each speculative-path row that runs prompt
    tokens (no draft tokens, ``query_len > 1``) reads and writes its column-0 slot only."""
    import torch

    from gdn_pass.vllm import compat

    def one_slot(builder, original_build, args, kwargs, md) -> None:
        slots_d = getattr(md, "state_indices_tensor_d", None)
        if slots_d is None or slots_d.dim() != 2 or getattr(md, "num_accepted_tokens", None) is None:
            return
        m, drafts = compat.step_inputs(original_build, builder, args, kwargs)
        decodes = int(md.num_decodes)
        if drafts is None or decodes == 0:
            return
        qlens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1])[:decodes]
        rows = [i for i in range(decodes) if int(drafts[i]) < 0 and int(qlens[i]) > 1]
        if not rows:
            return
        persistent = getattr(builder, "decode_state_indices_tensor", None)
        if persistent is None or slots_d.untyped_storage().data_ptr() != persistent.untyped_storage().data_ptr():
            slots_d = slots_d.clone()  # a view of the runner's block table otherwise
            md.state_indices_tensor_d = slots_d
        index = torch.tensor(rows, device=slots_d.device)
        slots_d[index] = slots_d[index, :1].expand(-1, slots_d.shape[1])
        counts = _ACTIVE.setdefault("chunk_rows_one_slot", [])
        counts.append(len(rows))

    _after_every_build(one_slot)


ZEROED_AT_START = "zeroed_at_start"
_MUTATIONS = {"skip_zeroing": _skip_zeroing, "zeroing_without_writes": _zeroing_without_writes,
              "nudge_live_rows": _nudge_live_rows, "harness_zeroing": _harness_zeroing,
              "chunk_rows_one_slot": _chunk_rows_one_slot,
              ZEROED_AT_START: lambda: None}  # done by the driver (harness.fuzz), not in the worker


def apply_mutation(name: str | None) -> None:
    """Apply the named deliberate break (``MUTATION_ENV``); ``None`` or "" applies none."""
    if not name:
        return
    if name not in _MUTATIONS:
        raise ValueError(f"{MUTATION_ENV}={name!r}: known mutations are {sorted(_MUTATIONS)}")
    _MUTATIONS[name]()


# vLLM imports this module in every worker before it builds the model, so the
# break is in place before any graph is captured.
apply_mutation(os.environ.get(MUTATION_ENV))
