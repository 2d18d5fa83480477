"""What the pass found and did to one compiled graph.

The pass object that an engine runs is often a pickled copy (vLLM sends it to
worker processes), so its fields are not where a caller looks: every report
is also kept in this process (``reports()``) and, when a report directory is
configured, written there as JSON and text.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["StateRead", "PassReport", "reports", "clear_reports", "load_reports"]

REPORT_DIR_ENV = "GDN_PASS_REPORT_DIR"


@dataclass
class StateRead:
    """One candidate state read and the decision taken on it."""

    node: str
    kind: str  # "opaque_op" | "gather"
    op: str
    layer: str | None
    # "guarded_gather" | "guarded_op" | "already_guarded" | "not_needed" (the engine's own fix holds,
    # the pass stands down) | "left_alone" (needed and not done: warned) | "not_state"
    action: str
    reason: str
    guard: str | None = None  # "masked_load" | "where" | "guarded_op"
    cache: str | None = None  # dtype[shape] of the state tensor, when the graph shows it
    index_source: str | None = None  # the node that supplies the slot indices


@dataclass
class PassReport:
    pass_name: str
    pass_uuid: str | None  # None: the pass made the graph uncacheable
    options: dict
    num_nodes: int
    analyses: list[str]
    graph_changed: bool = False
    reads: list[StateRead] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    seconds: float = 0.0
    created: float = field(default_factory=time.time)

    @property
    def guarded(self) -> list[StateRead]:
        return [r for r in self.reads if r.action in ("guarded_op", "guarded_gather")]

    def guarded_per_op(self) -> dict[str, int]:
        return dict(collections.Counter(r.op for r in self.guarded))

    @property
    def left_alone(self) -> list[StateRead]:
        return [r for r in self.reads if r.action == "left_alone"]

    @property
    def not_needed(self) -> list[StateRead]:
        return [r for r in self.reads if r.action == "not_needed"]

    def summary(self) -> str:
        """The one line logged per compiled graph."""
        if not self.guarded and not self.left_alone and not self.not_needed and not any(
            r.action == "already_guarded" for r in self.reads
        ):
            return (
                f"no GDN state reads in a graph of {self.num_nodes} nodes "
                "(graph unchanged)"
            )
        per_op = ", ".join(f"{op} x{n}" for op, n in sorted(self.guarded_per_op().items()))
        parts = [f"guarded {len(self.guarded)} state read(s) ({per_op or 'none'})"]
        already = sum(r.action == "already_guarded" for r in self.reads)
        if already:
            parts.append(f"{already} already guarded")
        if self.not_needed:
            parts.append(f"{len(self.not_needed)} not needed (the engine's own fix holds, see report)")
        if self.left_alone:
            parts.append(f"{len(self.left_alone)} LEFT UNGUARDED (see report)")
        parts.append(f"{self.num_nodes} nodes, {self.seconds * 1e3:.1f} ms")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["guarded_per_op"] = self.guarded_per_op()
        return d

    def to_text(self) -> str:
        lines = [self.summary(), f"  pass {self.pass_name} uuid {(self.pass_uuid or 'none (graph not cacheable)')[:16]}"]
        lines.append(f"  options {json.dumps(self.options, sort_keys=True)}")
        lines.append(f"  analyses {', '.join(self.analyses)}; graph changed: {self.graph_changed}")
        lines.append(f"  versions {self.versions}")
        for r in self.reads:
            where = f" cache={r.cache} slots={r.index_source}" if r.cache else ""
            lines.append(
                f"  - [{r.action}] {r.node}: {r.kind} {r.op} layer={r.layer}{where} ({r.reason})"
            )
        return "\n".join(lines)

    def write(self, directory: str | os.PathLike) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stem = f"report_{os.getpid()}_{int(self.created * 1e6)}"
        (directory / f"{stem}.json").write_text(json.dumps(self.to_dict(), indent=1))
        (directory / f"{stem}.txt").write_text(self.to_text() + "\n")
        return directory / f"{stem}.json"


_REPORTS: list[PassReport] = []


def record(report: PassReport, report_dir: str | None) -> None:
    _REPORTS.append(report)
    directory = report_dir or os.environ.get(REPORT_DIR_ENV)
    if directory:
        report.write(directory)


def reports() -> list[PassReport]:
    """Reports of every graph the pass ran on in this process, oldest first."""
    return list(_REPORTS)


def clear_reports() -> None:
    _REPORTS.clear()


def load_reports(directory: str | os.PathLike) -> list[dict]:
    """Reports written to ``directory`` (by any process), oldest first."""
    found = [json.loads(p.read_text()) for p in Path(directory).glob("report_*.json")]
    return sorted(found, key=lambda d: d["created"])
