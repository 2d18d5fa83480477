"""``gdn-pass doctor [MODEL]``: what gdn-pass would do with each state builder of the installed vLLM.

For every registry entry (``builders.REGISTRY``): whether this vLLM has the
builder, whether MODEL uses it (by its ``config.json`` architectures), what
the builder's own split does with a fresh row, and the decision: acts, stands
down, or refuses and why. The decision is ``support.decide`` on a builder made
here, for an engine with the pass configured and vLLM's default compilation
on this platform: the same function, on the same installed code, as at engine
start. An engine's own options can change a stand-down into acting (FULL
CUDA graphs on vLLM's V1 runner) and add a probe (speculative decoding);
the engine's start-up line says what it decided. Run in its own process by ``gdn_pass.cli`` (it imports vLLM).

    python -m gdn_pass.vllm.doctor [MODEL] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ENABLE = ('LLM(..., compilation_config={"inductor_compile_config": '
          '{"post_grad_custom_post_pass": gdn_pass.vllm.VllmGDNStatePass()}})')
ENABLE_SERVE = ("vllm serve MODEL --compilation-config "
                "'{\"inductor_passes\": {\"post_grad_custom_post_pass\": \"gdn_pass.vllm.serve.GDN_STATE_PASS\"}}'")


def model_architectures(model: str) -> list[str]:
    """The ``architectures`` of MODEL's config: a folder holding ``config.json``, or a Hugging Face id
    already in the local cache (the doctor never downloads)."""
    folder = Path(model)
    if folder.is_dir():
        config = folder / "config.json"
        if not config.exists():
            raise SystemExit(f"gdn-pass doctor: {model} has no config.json; give a model folder or a Hugging Face id")
    else:
        try:
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(model, "config.json", local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - any lookup failure is the user's answer
            raise SystemExit(f"gdn-pass doctor: {model} is neither a folder with config.json nor a Hugging Face id "
                             f"in the local cache ({type(exc).__name__}); download it first or give its folder") from None
    data = json.loads(config.read_text())
    architectures = list(data.get("architectures") or [])
    text = data.get("text_config") or {}
    return architectures + [a for a in text.get("architectures") or [] if a not in architectures]


def _engine_config(model: str | None):
    """A configured engine's ``VllmConfig`` with vLLM's defaults on this platform, for MODEL where given
    (as ``LLM(model=MODEL)`` would make it, without loading weights), else without a model."""
    from vllm.config import CompilationConfig, VllmConfig

    from gdn_pass.vllm import VllmGDNStatePass

    compilation = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()})
    extra = {"gdn_prefill_backend": "triton"}  # FlashInfer's GDN prefill may be absent; the split is the same
    if model is None:
        return VllmConfig(compilation_config=compilation, additional_config=extra)
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True, trust_remote_code=True, compilation_config=compilation,
                      additional_config=extra).create_engine_config()


def decisions(model: str | None = None) -> list[dict]:
    """One row per registry entry: ``entry``, ``builder``, ``present``, ``action``, ``why``, ``checks``."""
    import torch

    from gdn_pass.vllm import builders, support

    config = _engine_config(model)
    device = support._device(config)
    rows = []
    for entry in builders.REGISTRY:
        cls = entry.builder_class()
        row = {"entry": entry.key, "builder": entry.class_name, "models": entry.models,
               "architectures": list(entry.architectures), "present": cls is not None}
        if cls is None:
            row.update(action="absent", why=f"this vLLM has no vllm.{entry.module}.{entry.class_name}", checks=[])
        else:
            decision = support.decide_for_class(entry, cls, config, torch.device(device))
            if decision.failed() and decision.failed()[0].name == "builder" and model is None:
                row.update(action="needs MODEL", why=f"{decision.why}; give a model folder to decide",
                           checks=[])
                rows.append(row)
                continue
            row.update(action=decision.action, why=decision.why, keeps_decodes=decision.keeps_decodes,
                       checks=[{"name": c.name, "passed": c.passed, "found": c.found} for c in decision.checks])
        rows.append(row)
    return rows


def report(model: str | None) -> dict:
    import torch
    import vllm
    from vllm.platforms import current_platform

    from gdn_pass.vllm import compat

    architectures = model_architectures(model) if model else None
    rows = decisions(model)
    for row in rows:
        row["used_by_model"] = None if architectures is None else bool(set(row["architectures"]) & set(architectures))
    release = compat.vllm_version()
    return {"vllm": release, "tested": release.split("+")[0] in compat.TESTED_RELEASES, "torch": torch.__version__,
            "platform": current_platform.device_type,
            "vllm_path": os.path.dirname(vllm.__file__), "model": model, "model_architectures": architectures,
            "builders": rows}


def render(result: dict) -> str:
    tested = "tested" if result["tested"] else "newer than every tested release: decided by the checks below"
    lines = [f"gdn-pass doctor: vLLM {result['vllm']} ({tested}), torch {result['torch']}, "
             f"platform {result['platform']}; for an engine with the pass configured and vLLM's defaults"]
    if result["model"]:
        used = [r["entry"] for r in result["builders"] if r["used_by_model"]]
        lines.append(f"model {result['model']}: {', '.join(result['model_architectures']) or 'no architectures'}"
                     f" -> state builders: {', '.join(used) or 'none that gdn-pass knows (nothing to guard)'}")
    lines.append("")
    header = ("entry", "builder", "model uses", "gdn-pass")
    table = [header] + [(r["entry"], r["builder"], "-" if r["used_by_model"] is None else
                         ("yes" if r["used_by_model"] else "no"), r["action"]) for r in result["builders"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in result["builders"]:
        lines.append("")
        lines.append(f"{r['entry']} ({r['builder']}; {r['models']}): {r['action']}: {r['why']}")
        for c in r["checks"]:
            lines.append(f"  [{'ok' if c['passed'] else 'FAILED'}] {c['name']}: {c['found']}")
    acting = [r for r in result["builders"] if r["action"] in ("acts", "needs MODEL") and r["used_by_model"] is not False]
    lines.append("")
    if acting:
        lines.append("to switch the guard on (the plugin is installed; it does nothing until asked):")
        lines.append(f"  {ENABLE}")
        lines.append(f"  {ENABLE_SERVE}")
    else:
        lines.append("no builder here needs gdn-pass" + (" for this model" if result["model"] else "")
                     + ": configured, it stands down (or refuses, as said above)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gdn-pass doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a model folder (config.json) or a cached Hugging Face id")
    ap.add_argument("--json", action="store_true", help="print the decisions as JSON")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM logs to stdout: while it runs, its lines go to stderr; stdout is the report's
    try:
        result = report(args.model)
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
    print(json.dumps(result, indent=1) if args.json else render(result))
    refused = [r for r in result["builders"] if r["action"] == "refuses" and r["used_by_model"] is not False]
    return 1 if refused and args.model else 0


if __name__ == "__main__":
    sys.exit(main())
