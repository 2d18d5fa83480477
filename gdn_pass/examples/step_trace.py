"""What each engine step scheduled and how it ran, recorded inside vLLM's workers.

The GDN builder and the model runner live in the worker processes: in the
engine's own process with one GPU, in one process per rank with tensor
parallelism. ``StepTrace`` is given to vLLM as
``worker_extension_cls="gdn_pass.examples.step_trace.StepTrace"``; vLLM mixes
it into every worker, and the driver asks each rank through
``llm.collective_rpc``:

    llm.collective_rpc("gdn_trace_start")      # after start-up: capture builds are not steps
    ...engine steps...
    llm.collective_rpc("gdn_trace_summary")    # one dict per rank

Per step it records the rows of one GDN builder (every GDN group sees the
same requests) and, where the runner has it, the CUDA-graph dispatch of that
step (mode, real and padded token counts). ``gdn_zero_caches`` zeroes the
worker's caches, which is how the fuzz's reference engine starts each prompt
from a fresh engine's state. Test instrumentation only: the plugin itself
never installs it.
"""

from __future__ import annotations

import functools
from collections import Counter

__all__ = ["StepTrace", "row_kinds"]

_ACTIVE: dict = {}


def row_kinds(query_lens, num_computed_tokens, num_decodes: int, num_prefills: int,
              num_spec_decodes: int) -> Counter:
    """Counts of this step's row kinds, from vLLM's own fields.

    ``fresh_decode`` is the bug's trigger: a brand-new row in a step with no
    prefill, so it runs a decode kernel. ``spec`` rows come first in the
    builder's count when speculative decoding is on.
    """
    kinds: Counter = Counter()
    kinds["spec"] = num_spec_decodes
    for computed, q in zip(num_computed_tokens, query_lens):
        if q <= 0:
            continue  # padding
        if computed == 0:
            kinds["fresh_decode" if num_prefills == 0 else "fresh_prefill"] += 1
        elif q > 1 and num_spec_decodes == 0:
            kinds["continuation"] += 1  # a chunk of a prompt (or a prefix-hit remainder)
        else:
            kinds["decode"] += 1
    return kinds


class StepTrace:
    """Worker extension: methods vLLM adds to each worker (see module docstring)."""

    def gdn_trace_start(self, detail: bool = False) -> bool:
        """Start recording; ``detail`` also keeps each step's rows by request id."""
        from gdn_pass.vllm import compat

        state = _ACTIVE.setdefault("state", dict(steps=[], dispatch=None, builder=None))
        state["steps"].clear()
        state["detail"] = detail
        state["one_token_paths"] = {}
        state["runner"] = getattr(self, "model_runner", None)
        if _ACTIVE.get("installed"):
            return True
        builder_class = compat.builder_class()
        original_build = builder_class.build

        @functools.wraps(original_build)
        def build(builder, *args, **kwargs):
            md = original_build(builder, *args, **kwargs)
            if state["builder"] is None:
                state["builder"] = id(builder)
            if id(builder) == state["builder"]:
                m = compat.build_inputs(original_build, builder, args, kwargs)
                qlens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1])[: m.num_reqs]
                computed = m.compute_num_computed_tokens()[: m.num_reqs].cpu()
                slots = md.non_spec_state_indices_tensor
                state["steps"].append(dict(
                    rows=row_kinds(qlens.tolist(), computed.tolist(), md.num_decodes,
                                   md.num_prefills, getattr(md, "num_spec_decodes", 0) or 0),
                    real_rows=int((qlens > 0).sum()),
                    slot_rows=None if slots is None else int(slots.shape[0]),
                    dispatch=state["dispatch"]))
                ids = list(getattr(getattr(state["runner"], "input_batch", None), "req_ids", []))
                # The kernel path of each fresh one-token row (the last time it was fresh: a
                # request preempted before its first token is fresh again when resumed).
                for rid, c, q in zip(ids, computed.tolist(), qlens.tolist()):
                    if c == 0 and q == 1:
                        state["one_token_paths"][rid] = "prefill" if md.num_prefills > 0 else "decode"
                if state["detail"]:
                    all_slots = [] if slots is None else slots.tolist()
                    state["steps"][-1]["detail"] = dict(
                        req_ids=ids[: m.num_reqs], query_lens=qlens.tolist(), computed=computed.tolist(),
                        slots=all_slots, num_decodes=md.num_decodes, num_prefills=md.num_prefills)
                state["dispatch"] = None
            return md

        builder_class.build = build
        runner = getattr(self, "model_runner", None)
        decide = getattr(runner, "_determine_batch_execution_and_padding", None)
        if decide is not None:
            @functools.wraps(decide)
            def determine(*args, **kwargs):
                out = decide(*args, **kwargs)
                if kwargs.get("force_uniform_decode") is None:  # not a capture / dummy run
                    mode, desc = out[0], out[1]
                    state["dispatch"] = dict(mode=getattr(mode, "name", str(mode)),
                                             tokens=int(kwargs.get("num_tokens", args[0] if args else 0)),
                                             padded_tokens=int(desc.num_tokens))
                return out

            runner._determine_batch_execution_and_padding = determine
        _ACTIVE["installed"] = True
        return True

    def gdn_zero_caches(self) -> int:
        """Zero every layer's KV / conv / recurrent cache in this worker: a fresh engine's state.

        The caches live in the workers (one process per rank under tensor
        parallelism), so zeroing must run here, not in the driver. Returns
        the number of tensors zeroed.
        """
        import torch

        context = self.vllm_config.compilation_config.static_forward_context
        zeroed = [0]

        def zero(x):
            if isinstance(x, torch.Tensor):
                x.zero_()
                zeroed[0] += 1
            elif isinstance(x, (list, tuple)):
                for item in x:
                    zero(item)

        for layer in context.values():
            zero(getattr(layer, "kv_cache", None))
        return zeroed[0]

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
        from gdn_pass.vllm import metadata_hook, step_guard

        # whether this worker's process has the plugin's hook (entry point) and who guarded
        plugin = dict(hook_installed=metadata_hook.is_installed(), **step_guard.activity())
        return dict(steps=len(steps), rows=dict(rows), cudagraph_modes=dict(modes), plugin=plugin,
                    fresh_decode_steps=fresh_decode, padded_graph_steps=padded_graph,
                    fresh_decode_in_padded_full_graph=fresh_in_padded_full,
                    one_token_paths=dict(state.get("one_token_paths", {})),
                    spec_steps=sum(s["rows"]["spec"] > 0 for s in steps))
