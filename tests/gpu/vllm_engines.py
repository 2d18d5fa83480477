"""Scenario engines on the GPU machine, each in its own process, many at once.

Shared by the GPU end-to-end tests (``test_vllm_e2e.py``, ``test_vllm_families.py``).
Every engine gets a small KV cache of its own (``kv_cache_memory_bytes`` also
makes vLLM skip memory profiling, which fails while other engines allocate)
and compile caches of its own, so the pass runs in each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from harness import engine_ports

ENGINE = [
    "kv_cache_memory_bytes=268435456",
    "gpu_memory_utilization=0.05",
]
# Where FlashInfer is not installed (the H200 stacks of vLLM 0.26 and 0.34,
# ../shared/gpu-vllm/README.md), GDN models need vLLM's Triton GDN prefill: on Hopper
# vLLM's "auto" picks FlashInfer's. scripts/test-gpu sets GDN_PASS_GPU_GDN_PREFILL_BACKEND
# from what it finds; unset, the Triton backend is asked for (harmless where FlashInfer exists).
GDN_PREFILL_BACKEND = os.environ.get("GDN_PASS_GPU_GDN_PREFILL_BACKEND", "triton")
if GDN_PREFILL_BACKEND not in ("", "auto"):
    ENGINE.append(f'additional_config={{"gdn_prefill_backend": "{GDN_PREFILL_BACKEND}"}}')
ENGINE_TIMEOUT_S = int(os.environ.get("GDN_PASS_GPU_ENGINE_TIMEOUT_S", "540"))
# R3 alone vs R3 next to R2 with the pass, in one mode: same tokens, and
# logprobs equal up to bf16 rounding of a different batch.
LOGPROB_TOL = 1e-2


def scenario(name: str, scenario: str, guard: str, model: Path, workdir: Path, compilation=(),
             env_extra=None, extra=()) -> dict:
    """Run ``gdn_pass.vllm.checker.scenarios`` in a fresh engine process; its result, or its error and log tail."""
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "gdn_pass.vllm.checker.scenarios", scenario, "--model", str(model),
           "--guard", guard, "--out", str(out), "--report-dir", str(workdir / f"reports_{name}")]
    cmd += [a for item in ENGINE for a in ("--engine-arg", item)]
    cmd += [a for item in compilation for a in ("--compilation-arg", item)]
    cmd += list(extra)
    # tests/vllm's conftest, if collected too, turns the compile caches off.
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               VLLM_DISABLE_COMPILE_CACHE="0", TORCHINDUCTOR_COMPILE_THREADS="1",
               VLLM_CACHE_ROOT=str(workdir / f"cache_{name}"),
               TORCHINDUCTOR_CACHE_DIR=str(workdir / f"cache_{name}" / "inductor"))
    for var in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        env.pop(var, None)
    # FlashInfer's sampler only where scripts/test-gpu found FlashInfer (the H200 stacks have none).
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.update(env_extra or {})
    env = engine_ports.engine_env(env)  # many engines start at once: no shared port
    start = time.time()
    with open(log, "w") as f:
        try:
            returncode = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        timeout=ENGINE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            returncode = f"timeout after {ENGINE_TIMEOUT_S}s"
    text = log.read_text()
    if returncode != 0:
        return dict(name=name, error=f"exit {returncode}", engine_error=engine_error(text),
                    log_tail=text[-4000:], wall_s=round(time.time() - start, 1))
    result = json.loads(out.read_text())
    reports = workdir / f"reports_{name}"
    result.update(name=name, wall_s=round(time.time() - start, 1),
                  pass_reports=len(list(reports.glob("*.json"))) if reports.exists() else 0,
                  compile_cache_hit="Directly load" in text,
                  # the plugin's start-up lines (gdn_pass.vllm.metadata_hook)
                  stand_down_logged="standing down" in text,
                  keeps_decodes_logged="keeps one-token steps on the decode path" in text,
                  # gdn_pass.vllm.accepted_counts: the V2 runner's counts passed to the Lightning builder
                  counts_supplied_logged="gdn-pass passes it the ones the runner passes" in text)
    return result


def engine_error(log: str) -> str | None:
    """The last exception line of a failed engine's log, with the detail line after it."""
    lines = [re.sub(r"^(\(\w+ pid=\d+\)|\[rank\d+\]:)\s*", "", ln).strip() for ln in log.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^\w+(\.\w+)*(Error|Exception)\b", lines[i]):
            return re.sub(r"\s*\[type=.*", "", " / ".join(x for x in lines[i: i + 2] if x))[:400]
    return None


def vllm_reroutes_fresh_rows(off: dict) -> bool:
    """Did the engine's own builder send the scenario's fresh row to its prefill path? (pass off)

    From what the engine reported, not from a version table: R3 was scheduled next to a
    decoding R2 (``fresh_beside_decode_steps``) and no such step had the fresh row on the
    decode path (``fresh_decode_steps``). True for GDN from vLLM 0.31 (vllm#51565), never
    for the Lightning builders (0.26-0.34).
    """
    return off.get("fresh_beside_decode_steps", 0) > 0 and off["fresh_decode_steps"] == 0
