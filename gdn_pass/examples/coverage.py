"""Model-family x vLLM-mode coverage, recorded by the tests and rendered for the README.

Tests call ``record(family, mode, **evidence)``; each call updates one cell of
a JSON file (``GDN_PASS_COVERAGE_FILE``, default ``artifacts/coverage.json``).
``python -m gdn_pass.examples.coverage FILE --readme README.md`` renders the
table between the README's coverage markers, so the table is what the tests
last saw, not what someone typed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["record", "render", "COVERAGE_FILE_ENV"]

COVERAGE_FILE_ENV = "GDN_PASS_COVERAGE_FILE"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"


def _path() -> Path:
    return Path(os.environ.get(COVERAGE_FILE_ENV, "artifacts/coverage.json"))


def record(family: str, mode: str, **evidence) -> None:
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(family, {})[mode] = evidence
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def _cell(evidence: dict) -> tuple[str, str | None]:
    """Short table cell, and a note for below the table."""
    status = evidence.get("status")
    if status == "e2e":
        if evidence.get("reproduced") and evidence.get("fixed") and evidence.get("r2_unchanged", True):
            return "fixed e2e", None
        return "NOT FIXED", (f"reproduced={evidence.get('reproduced')}, fixed={evidence.get('fixed')}, "
                             f"other rows unchanged={evidence.get('r2_unchanged')}")
    if status == "cpu_unsupported":
        return "CPU backend cannot run it", f"`{evidence.get('error', '')}`"
    if status == "op_guard":
        return "guarded", evidence.get("detail")
    if status == "not_guardable":
        return "not guardable by a graph pass", evidence.get("detail")
    return evidence.get("cell", status or "?"), evidence.get("detail")


def render(data: dict) -> str:
    """One row per (family, mode) the tests covered; details below as numbered notes."""
    rows = ["| family | vLLM mode | result |", "|---|---|---|"]
    notes = []
    for family in sorted(data):
        for mode in sorted(data[family], key=str.lower):
            cell, note = _cell(data[family][mode])
            if note:
                notes.append(f"{len(notes) + 1}. {note}")
                cell += f" [{len(notes)}]"
            rows.append(f"| {family} | {mode} | {cell} |")
    return "\n".join(rows + [""] + notes)


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
    ap.add_argument("--readme", type=Path, default=None, help="rewrite this README's table")
    args = ap.parse_args()
    table = render(json.loads(args.coverage_json.read_text()))
    if args.readme:
        update_readme(args.readme, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
