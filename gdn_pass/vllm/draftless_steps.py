"""Steps with a draftless row of ``1 + k`` tokens kept off the speculative FULL CUDA graph (V1 runner).

With ``k`` speculative tokens, vLLM's V1 model runner picks the step's CUDA
graph from its shape *before* the metadata is built: a step whose rows all
have ``1 + k`` tokens is a "uniform decode", and with FULL graphs it replays
the graph captured for speculative decodes of that shape. GDN's builder
(vLLM 0.26-0.30, where gdn-pass acts for it) classifies rows by their drafts
instead (``num_decode_draft_tokens_cpu >= 0``): a row of ``1 + k`` tokens
without drafts, a prompt's last chunk, is a prefill, and a step with a prefill
stages none of the graph's persistent decode buffers
(``spec_state_indices_tensor``, ``spec_query_start_loc``, ...). The replayed
graph then reads and writes the slots of the last step that staged them. In
the GPU scheduling fuzz (H200, vLLM 0.26, Qwen3-Next MTP, k = 1, 8-token
chunks) the 13 prompts of length 2 mod 8 ran their last chunk that way, and
all 13 came out otherwise than from a reference without FULL graphs
(``benchmarks/results/fuzz_scheduling_gpu.md``).

This module makes such a step what it is, a step with a prefill, before the
graph is chosen (vLLM's V2 runner keeps steps with a prompt chunk off FULL
graphs itself):

    before (V1 runner)                           after
    uniform = every row has 1 + k tokens         uniform = every row has 1 + k tokens
                                                           and every row has drafts
    -> FULL graph of k-draft decodes             -> PIECEWISE graphs (or none): the metadata
       on buffers another step staged               the builder built for this step

The Lightning builders need no such change: they count a short extend as a
speculative decode and stage the graph's buffers for it (``prompt_chunks``
repairs its columns).

Invariants: only engines with a speculating builder gdn-pass acts for, FULL
graphs and the V1 runner are changed (``keep_off_full_graphs``, at engine
start); in them, only a step of the uniform shape with a row without drafts
(``num_decode_draft_tokens < 0``), a step vLLM would run wrongly; a call that
already forces the choice (CUDA-graph capture, dummy runs) is never changed.
A step costs one shape check, and a step of the uniform shape one look at
whether it has drafts (recorded where ``_prepare_inputs`` starts, before the
choice) and, where it has, at the draft counts ``_prepare_inputs`` wrote for
it (in a step without drafts vLLM leaves a past step's there).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref

from gdn_pass._logging import logger

__all__ = ["RUNNER", "activity", "keep_off_full_graphs"]

# The V1 model runner and the method that chooses a step's CUDA graph (vLLM 0.26-0.33).
RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
_CHOOSE = "_determine_batch_execution_and_padding"
_PARAMETERS = ("num_tokens", "num_reqs", "max_num_scheduled_tokens", "force_uniform_decode")
# The runner's per-step input preparation, which runs before the choice: it writes the step's
# draft counts only in a step where some row has drafts (0.26-0.31: ``use_spec_decode``), so in a
# step without any they are a past step's. Whether the step has drafts is read where it starts.
_PREPARE = "_prepare_inputs"
_STEP_HAS_DRAFTS = "_gdn_pass_step_has_drafts"
_MARK = "_gdn_pass_draftless_steps"
# The builders that asked for this: a runner keeps such steps off FULL graphs when it runs one of
# them (decided at its first step and kept on the runner).
_BUILDERS: weakref.WeakSet = weakref.WeakSet()
_RUNNER_FLAG = "_gdn_pass_keeps_draftless_steps_off_full_graphs"
# steps: kept off the FULL graph; checked: steps of such engines' runners (every step there)
_ACTIVITY = {"steps": 0, "checked": 0}
_said: set[str] = set()


def keep_off_full_graphs(builder, vllm_config) -> None:
    """Keep ``builder``'s engine's draftless ``1 + k``-token steps off the speculative FULL graph.

    For a speculating builder gdn-pass acts for whose own split sends a draftless
    row to its prefill path (GDN's); said once at start-up. Nothing applies without
    speculation, without FULL graphs or on the V2 runner; where the runner is not
    the one read here, nothing is changed and a start-up warning says what remains.
    """
    from gdn_pass.vllm import support

    if not getattr(builder, "use_spec_decode", False):
        return
    # the builder's own reading of the mode where it keeps one (GDN: it stages FULL buffers by it)
    full = getattr(builder, "use_full_cuda_graph", None)
    if full is None:
        full = support.captures_full_graphs(vllm_config)
    if not full or support.runs_v2_model_runner(vllm_config):
        return
    name = type(builder).__name__
    why_not = _wrap_runner()
    if why_not is not None:
        _say_once(f"cannot:{name}", f"gdn-pass: {name}'s speculative FULL CUDA graph can replay on a step "
                  f"whose prompt chunk of 1 + k tokens it builds as a prefill, and gdn-pass cannot prevent "
                  f"it: {why_not}. Such prompts can come out wrong (vLLM's own); cudagraph_mode="
                  "PIECEWISE avoids it")
        return
    _BUILDERS.add(builder)
    _say_once(f"keeps:{name}", f"gdn-pass: steps with a prompt chunk of 1 + k tokens and no drafts run "
              f"without the speculative FULL CUDA graph ({name} builds them as prefills)", info=True)


def activity() -> dict:
    """``{"steps": n, "checked": m}``: the steps kept off the speculative FULL graph in this process,
    of the ``m`` steps of engines where it applies."""
    return dict(_ACTIVITY)


def _wrap_runner() -> str | None:
    """Wrap the V1 runner's graph choice (once); None when it is wrapped, else why it cannot be."""
    try:
        runner = getattr(importlib.import_module(RUNNER[0]), RUNNER[1])
        original = getattr(runner, _CHOOSE)
    except (ImportError, AttributeError) as exc:
        return f"vLLM's V1 runner has no {RUNNER[1]}.{_CHOOSE} ({exc})"
    if getattr(original, _MARK, False):
        return None
    missing = [p for p in _PARAMETERS if p not in inspect.signature(original).parameters]
    if missing:
        return f"{RUNNER[1]}.{_CHOOSE} takes no {', '.join(missing)}"
    original_prepare = getattr(runner, _PREPARE, None)
    if original_prepare is None or list(inspect.signature(original_prepare).parameters)[1:2] != ["scheduler_output"]:
        return f"{RUNNER[1]}.{_PREPARE} does not take the step's scheduler_output first"

    @functools.wraps(original_prepare)
    def prepare_inputs(self, scheduler_output, *args, **kwargs):
        self.__dict__[_STEP_HAS_DRAFTS] = bool(getattr(scheduler_output, "scheduled_spec_decode_tokens", True))
        return original_prepare(self, scheduler_output, *args, **kwargs)

    @functools.wraps(original)
    def choose(self, *args, **kwargs):
        if not args and kwargs.get("force_uniform_decode") is None:  # a step (capture forces the choice)
            keeps = self.__dict__.get(_RUNNER_FLAG)
            if keeps is None:
                keeps = self.__dict__[_RUNNER_FLAG] = _runs_such_a_builder(self)
            if keeps:
                _ACTIVITY["checked"] += 1
                if _draftless_uniform_step(self, kwargs):
                    _ACTIVITY["steps"] += 1
                    kwargs["force_uniform_decode"] = False
        return original(self, *args, **kwargs)

    setattr(choose, _MARK, True)
    setattr(runner, _PREPARE, prepare_inputs)
    setattr(runner, _CHOOSE, choose)
    return None


def _runs_such_a_builder(runner) -> bool:
    """Does ``runner`` run a builder that asked for this (``keep_off_full_graphs``)?"""
    groups = getattr(runner, "attn_groups", None) or ()
    return any(builder in _BUILDERS for per_kv_group in groups for group in per_kv_group
               for builder in getattr(group, "metadata_builders", ()))


def _draftless_uniform_step(runner, kwargs: dict) -> bool:
    """Is this step of the speculative decode shape with a row that has no drafts?"""
    width = getattr(runner, "uniform_decode_query_len", 1)
    longest, num_reqs = kwargs.get("max_num_scheduled_tokens"), kwargs.get("num_reqs")
    if width <= 1 or not num_reqs or longest != width or kwargs.get("num_tokens") != width * num_reqs:
        return False  # not the shape the runner takes for a speculative decode (most steps)
    if not runner.__dict__.get(_STEP_HAS_DRAFTS, True):
        return True  # no row of the step has drafts (the runner's counts are a past step's)
    drafts = getattr(getattr(runner, "num_decode_draft_tokens", None), "np", None)
    if drafts is None:
        _say_once("no-drafts", "gdn-pass: vLLM's V1 runner keeps no num_decode_draft_tokens; steps with "
                  "a prompt chunk of 1 + k tokens may replay the speculative FULL CUDA graph")
        return False
    row = drafts[:num_reqs].argmin()  # argmin, not min: numpy's reductions cost more per call
    return bool(drafts[row] < 0)


def _say_once(key: str, message: str, *, info: bool = False) -> None:
    if key not in _said:
        _said.add(key)
        (logger.info if info else logger.warning)(message)
