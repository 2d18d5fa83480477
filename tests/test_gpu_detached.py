"""scripts/gpu-detached: a group started in one call runs on in a copy of the tree, and a later
call's wait reports how it ended, packs its results, and the hashes check against the checkout."""

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/gpu-detached"


def _run(*args, env):
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def test_start_then_wait(tmp_path):
    env = {**os.environ, "GDN_PASS_DETACHED_ROOT": str(tmp_path / "runs"), "OUT": str(tmp_path)}
    env.pop("GDN_PASS_GPU_RESULTS", None)
    ok = 'mkdir -p "$GDN_PASS_GPU_RESULTS" && pwd > "$GDN_PASS_GPU_RESULTS/where.txt"'
    assert _run("start", "good", "bash", "-c", ok, env=env).returncode == 0
    assert _run("start", "bad", "bash", "-c", "exit 3", env=env).returncode == 0
    assert _run("start", "slow", "sleep", "29.5", env=env).returncode == 0
    waited = _run("wait", "8", "good", "bad", "slow", env=env)
    assert waited.returncode == 0, waited.stderr
    assert "== good: exit 0 after" in waited.stdout
    assert "== bad: exit 3 after" in waited.stdout
    assert "== slow: still running" in waited.stdout
    run = tmp_path / "runs" / "good"
    # the command ran in the copy, not in the checkout
    assert (run / "results/where.txt").read_text().strip() == str(run / "tree")
    check = subprocess.run(["sha256sum", "-c", "--quiet", str(run / "hashes.txt")], cwd=ROOT,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    assert "gdn_pass/vllm/metadata_hook.py" in (run / "hashes.txt").read_text()
    with tarfile.open(tmp_path / "gpu-detached.tgz") as packed:
        names = packed.getnames()
    assert "./good/results/where.txt" in names and "./bad/done" in names
    assert not any("/tree/" in n for n in names)
    subprocess.run(["pkill", "-f", "sleep 29.5"], check=False)


def test_start_without_a_command_is_refused(tmp_path):
    env = {**os.environ, "GDN_PASS_DETACHED_ROOT": str(tmp_path)}
    refused = _run("start", "nothing", env=env)
    assert refused.returncode == 2 and "no COMMAND" in refused.stderr
