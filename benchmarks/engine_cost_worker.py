"""Worker side of benchmarks/engine_cost.py: the bug report's alternative, switchable, and a poison check.

vLLM imports this module in every worker of an engine given
``worker_extension_cls="benchmarks.engine_cost_worker.BenchWorker"``; the
driver calls the methods through ``llm.collective_rpc``. Benchmarks only.

The alternative to gdn-pass that vllm#51562 proposes is one line: the GDN
builder splits its batch with ``split_decodes_and_prefills(...,
treat_short_extends_as_decodes=False)``, so that a brand-new one-token
request runs on the prefill path. On vLLM's V1 model runner (0.26) that line
alone is not enough under FULL CUDA graphs: the runner picks the graph from
the query lengths only, so a step whose rows all have one token replays the
decode graph, whose metadata buffers the builder then leaves unwritten
(it writes them only for steps without prefills). vLLM's upstream fix relies
on its V2 runner, which keeps steps with a prefilling row out of FULL decode
graphs. ``alternative_set(split=True, runner=True)`` does both here: the
split, and a runner that treats a step with a prefilling row as not a
uniform decode (PIECEWISE). ``split=True, runner=False`` is the one line
alone, for the correctness check only. On the V2 runner (vLLM 0.34 has no
other) the runner part is the runner's own: ``runner=True`` changes nothing.
"""

from __future__ import annotations

import functools

from vllm.v1.attention.backends import gdn_attn, linear_attn

from harness.step_trace import fill_caches

_switch = {"split": False, "runner": False}
# The line goes into every builder module with the bug: GDN's, and the Lightning builders'
# (Bailing's ``build`` has the same split and the same ``num_prefills == 0`` staging).
_SPLIT_MODULES = (gdn_attn, linear_attn)


def _switchable(split):
    if getattr(split, "switchable", False):
        return split

    @functools.wraps(split)
    def switchable_split(*args, **kwargs):
        if _switch["split"]:
            kwargs["treat_short_extends_as_decodes"] = False
        return split(*args, **kwargs)

    switchable_split.switchable = True
    return switchable_split


for _module in _SPLIT_MODULES:
    _module.split_decodes_and_prefills = _switchable(_module.split_decodes_and_prefills)


def _prefilling_rows(runner) -> bool:
    """Does this step have a request still in its prompt (a fresh one-token row among them)?"""
    batch = runner.input_batch
    n = batch.num_reqs
    return bool((batch.num_computed_tokens_cpu_tensor[:n] < batch.num_prompt_tokens_cpu_tensor[:n]).any())


class BenchWorker:
    """Worker extension: the alternative's switches and the cache fill of the poison check."""

    def alternative_set(self, split: bool, runner: bool) -> bool:
        """Switch the alternative's two parts in this worker; True if both are in place."""
        model_runner = self.model_runner
        v1_runner = hasattr(model_runner, "_is_uniform_decode")  # the V2 runner keeps prefills off FULL graphs
        if v1_runner and not getattr(model_runner, "_bench_uniform_wrapped", False):
            original = model_runner._is_uniform_decode

            def is_uniform_decode(*args, **kwargs):
                uniform = original(*args, **kwargs)
                if uniform and _switch["runner"] and kwargs.get("force_uniform_decode") is None:
                    return not _prefilling_rows(model_runner)
                return uniform

            model_runner._is_uniform_decode = is_uniform_decode
            model_runner._bench_uniform_wrapped = True
        _switch.update(split=bool(split), runner=bool(runner))
        return all(getattr(m.split_decodes_and_prefills, "switchable", False) for m in _SPLIT_MODULES)

    def bench_init_weights(self, std: float, seed: int) -> int:
        """Redraw every weight matrix of this worker's model from N(0, std); the count redrawn.

        ``load_format="dummy"`` draws weights from U(-1e-3, 1e-3). With
        Qwen3-Next-80B's dimensions the logits then come out almost uniform, and
        a poisoned state slot does not move the fresh row's logprob (H200 runs 2
        and 3: -11.4273 on zeroed and on poisoned caches alike). Matrices at
        ``std`` (0.02, the usual initialisation scale) carry the state through.
        The shapes stay the same, and so does the work per step. Vectors (norm
        weights, biases, ``A_log``, ``dt_bias``) keep their dummy values.
        """
        import torch

        generator = None
        count = 0
        for param in self.model_runner.model.parameters():
            if param.dim() < 2 or not param.is_floating_point():
                continue
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            param.data.normal_(0.0, std, generator=generator)
            count += 1
        return count

    def bench_fill_caches(self, value: float) -> int:
        """Every KV / conv / recurrent cache of this worker set to ``value``; the count of tensors."""
        return fill_caches(self.vllm_config, value)
