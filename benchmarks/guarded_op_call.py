"""What one call of a guarded GDN core op costs the host beyond the original op's call.

A compiled engine's piecewise step calls vLLM's GDN core op once per GDN
layer (36 in Qwen3-Next-80B); with gdn-pass the graph calls the guarded op
instead (``gdn_pass.vllm.guarded_ops``): the op guard, then the original.
Three ways to make that call, timed interleaved in one process (best of
``--repeat`` runs of ``--number`` calls each, us per call):

    original            torch.ops.vllm.<op>(...)              a plain engine's call
    guarded, dispatched the op guard, then torch.ops.vllm.<op>  the guarded op before it
                                                                called vLLM's function directly
    guarded, direct     torch.ops.gdn_pass.guarded_<op>(...)  gdn-pass's guarded op now:
                                                                the op guard, then vLLM's function

Every call does only its host work: the forward context has no metadata
(as in vLLM's profiling run), so the op guard returns at its first check and
vLLM's function finds a layer whose core does nothing. The op guard's own
per-step path is timed by ``hook_host_time.py --forward``.

    python benchmarks/guarded_op_call.py [--number N] [--repeat R] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def core_op(device: torch.device):
    """vLLM's GDN core op for ``device``, registered as the model's layer registers it."""
    if device.type == "cpu":
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

        gdn_attention.register_cpu_gdn_attention_ops()
        return torch.ops.vllm.cpu_gdn_attention_core.default
    try:
        import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn  # noqa: F401 (0.30+)
    except ImportError:
        import vllm.model_executor.layers.mamba.gated_delta_net  # noqa: F401 (older layouts)
    return torch.ops.vllm.qwen_gdn_attention_core.default


def fake_forward_context(layer_name: str):
    """vLLM's forward context of a profiling run, seen by vLLM's function and by the op guard alike."""
    import vllm.forward_context

    class IdleLayer:
        prefix = layer_name

        def _forward_core(self, *args, **kwargs):
            return None

    context = SimpleNamespace(attn_metadata=None, no_compile_layers={layer_name: IdleLayer()})
    vllm.forward_context.get_forward_context = lambda: context
    for module in list(sys.modules.values()):  # the functions' own imported name
        if getattr(module, "__name__", "").startswith("vllm.") and "get_forward_context" in getattr(
                module, "__dict__", {}):
            module.get_forward_context = vllm.forward_context.get_forward_context


def dispatched_twin(op):
    """The guarded op as it was: the op guard, then the original through the dispatcher."""
    from gdn_pass.vllm.guarded_ops import _schema_tail
    from gdn_pass.vllm.op_guard import zero_fresh_state

    lib = torch.library.Library("gdn_pass_bench", "FRAGMENT")
    name = "dispatched_" + op.name().split("::", 1)[1]
    lib.define(name + _schema_tail(op))
    index = [a.name for a in op._schema.arguments].index("layer_name")

    def impl(*args, **kwargs):
        layer = kwargs["layer_name"] if "layer_name" in kwargs else args[index]
        zero_fresh_state(getattr(layer, "value", layer))
        return op(*args, **kwargs)

    lib.impl(name, impl, "CompositeExplicitAutograd")
    return getattr(torch.ops.gdn_pass_bench, name).default, lib


def call_args(op, device: torch.device, layer_name: str) -> tuple:
    """Arguments of the op's schema: small tensors, the layer's name (a LayerName where the schema
    takes an opaque object), the defaults for the rest."""
    args = []
    for arg in op._schema.arguments:
        kind = str(arg.type)
        if arg.name == "layer_name":
            if kind == "str":
                args.append(layer_name)
            else:
                from vllm.utils.torch_utils import LayerName

                args.append(LayerName(layer_name))
        elif "Tensor" in kind:
            args.append(torch.zeros(4, 8, dtype=torch.bfloat16, device=device))
        elif arg.has_default_value():
            args.append(arg.default_value)
        else:
            raise SystemExit(f"no argument made for {arg.name}: {kind}")
    return tuple(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=None)
    options = ap.parse_args()

    import vllm

    from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS
    from gdn_pass.vllm import guarded_ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    op = core_op(device)
    spec = KNOWN_OPAQUE_STATE_OPS[op.name()]
    layer_name = "model.layers.0.linear_attn"
    fake_forward_context(layer_name)
    guarded = guarded_ops.guarded_overload(op, spec)
    dispatched, _lib = dispatched_twin(op)
    args = call_args(op, device, layer_name)
    variants = {"original": op, "guarded, dispatched": dispatched, "guarded, direct": guarded}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for fn in variants.values():
            fn(*args)  # first calls outside the timing
        for _ in range(options.repeat):  # interleaved: the host's drift hits every variant alike
            for name, fn in variants.items():
                runs[name].append(timeit.timeit(lambda: fn(*args), number=options.number) / options.number * 1e6)
    best = {name: min(values) for name, values in runs.items()}
    median = {name: statistics.median(values) for name, values in runs.items()}
    function = guarded_ops.registered_function(op)
    result = {
        "command": "python benchmarks/guarded_op_call.py " + " ".join(sys.argv[1:]),
        "commit": _commit(), "op": op.name(), "device": torch.cuda.get_device_name() if device.type == "cuda"
        else platform.processor() or "cpu", "vllm": vllm.__version__, "torch": torch.__version__,
        "function_found": None if function is None else f"{function.__module__}.{function.__name__}",
        "us_per_call_best": {k: round(v, 3) for k, v in best.items()},
        "us_per_call_median": {k: round(v, 3) for k, v in median.items()},
        "number": options.number, "repeat": options.repeat,
    }
    original = best["original"]
    lines = [f"{result['op']} on {result['device']}, vLLM {result['vllm']}, torch {result['torch']}, "
             f"commit {result['commit']}; vLLM's function: {result['function_found']}",
             "| call | us per call (best) | median | beyond the original's call, us | x the original |",
             "|---|---|---|---|---|"]
    for name in variants:
        lines.append(f"| {name} | {best[name]:.3f} | {median[name]:.3f} | {best[name] - original:+.3f} | "
                     f"x{best[name] / original:.2f} |")
    saved = best["guarded, dispatched"] - best["guarded, direct"]
    lines.append(f"\nper step of 36 guarded layers: {36 * (best['guarded, direct'] - original):.1f} us now, "
                 f"{36 * (best['guarded, dispatched'] - original):.1f} us dispatched ({36 * saved:.1f} saved)")
    print("\n".join(lines))
    if options.out:
        os.makedirs(options.out, exist_ok=True)
        Path(options.out, "guarded_op_call.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
