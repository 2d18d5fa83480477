"""harness.engine_ports: every engine a GPU test starts gets a port range no other engine has."""

import subprocess
import sys
from pathlib import Path

from harness import engine_ports

ROOT = Path(__file__).resolve().parents[1]


def test_bases_differ_across_processes(tmp_path, monkeypatch):
    counter = tmp_path / "ports"
    monkeypatch.setattr(engine_ports, "COUNTER", counter)
    script = ("from pathlib import Path; from harness import engine_ports as e; "
              f"e.COUNTER = Path({str(counter)!r}); print(*[e.next_base() for _ in range(20)])")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(4)]
    bases = [int(b) for p in procs for b in p.communicate()[0].split()]
    bases += [engine_ports.next_base() for _ in range(5)]
    assert len(bases) == 85 and len(set(bases)) == 85
    assert all(engine_ports.FIRST <= b and b + engine_ports.SPAN <= 32768 for b in bases)
    assert all((b - engine_ports.FIRST) % engine_ports.SPAN == 0 for b in bases)


def test_a_chosen_port_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_ports, "COUNTER", tmp_path / "ports")
    assert engine_ports.engine_env({"VLLM_PORT": "40000"}) == {"VLLM_PORT": "40000"}
    first = engine_ports.engine_env({"A": "1"})
    assert first["A"] == "1" and first["VLLM_PORT"] == str(engine_ports.FIRST)
    assert engine_ports.engine_env({})["VLLM_PORT"] == str(engine_ports.FIRST + engine_ports.SPAN)
