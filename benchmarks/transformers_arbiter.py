"""Which side of a fuzz mismatch the model itself takes: Transformers as a third engine.

A fuzz mismatch (``harness/fuzz.py``) says that a request's tokens in the
stream differ from its prompt run alone; it does not say which of the two
engines computed the model wrongly. This tool recomputes the position where
they part with Hugging Face Transformers on CPU, from the same seeded tiny
checkpoint (``harness.tiny_checkpoints``), with neither vLLM's kernels nor
its scheduler:

    prefix = prompt + the tokens both engines agree on
    logprobs = Transformers(checkpoint)(prefix)[-1].log_softmax()
    side = "stream"    if the stream's token is Transformers' top token and the reference's is
                          more than --tie below it
           "reference" the other way round
           "near tie"  if the two tokens are within --tie of each other
           "neither"   otherwise (Transformers' top token is a third one)

Only checkpoints whose model Transformers implements in-tree are supported
(the Qwen3-Next kinds; the MTP layer's weights are ignored, greedy speculative
decoding must give plain decoding's tokens).

    python benchmarks/transformers_arbiter.py --kind qwen3_next_mtp --prompt 1,2,3 \\
        --stream 659 --reference 355                    # one case, from the command line
    python benchmarks/transformers_arbiter.py --kind qwen3_next_mtp \\
        --summary benchmarks/results/fuzz_scheduling_gpu_034.json --key mtp --run off
                                                        # every mismatch a fuzz summary kept
                                                        # (runs.<run>.mismatched_outputs)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIE = 0.1  # nats: two tokens this close are a near tie for a bf16 model (the fuzz judge's bound is per reference)


@dataclass
class Verdict:
    request: str
    position: int  # the first generated position where stream and reference differ
    stream_token: int
    reference_token: int
    top_token: int  # Transformers' greedy choice there
    stream_logprob: float
    reference_logprob: float
    top_logprob: float
    reference_rank: int  # how many tokens Transformers ranks above the reference's
    side: str


def first_difference(stream: list[int], reference: list[int]) -> int | None:
    """The first position where the two token lists differ (None where one is a prefix of the other)."""
    for i, (a, b) in enumerate(zip(stream, reference)):
        if a != b:
            return i
    return None


def side_of(logprobs, stream_token: int, reference_token: int, tie: float = TIE) -> str:
    """Which engine's token the model's own distribution ``logprobs`` (1-D) supports."""
    s, r = float(logprobs[stream_token]), float(logprobs[reference_token])
    if abs(s - r) <= tie:
        return "near tie"
    top = int(logprobs.argmax())
    if top == stream_token:
        return "stream"
    if top == reference_token:
        return "reference"
    return "neither"


class TransformersModel:
    """The tiny checkpoint ``kind`` (seeded as the GPU tests write it) in Transformers, on CPU.

    Computed in float32 by default: against R3 of the README scenario in vLLM's CPU engine
    its logprobs are within 0.10 (bfloat16: 0.20), its tokens the same
    (``tests/vllm/test_transformers_arbiter.py``).
    """

    def __init__(self, kind: str, seed: int = 0, dtype: str = "float32"):
        import torch

        from harness.tiny_checkpoints import write_checkpoint  # every kind the tests run

        self._tmp = tempfile.TemporaryDirectory(prefix="gdn_pass_arbiter_")
        path = write_checkpoint(kind, self._tmp.name, seed=seed)
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") != "qwen3_next":
            raise SystemExit(f"{kind}: model_type {config.get('model_type')!r} has no in-tree Transformers "
                             "model this tool knows (Qwen3-Next kinds only)")
        from transformers import Qwen3NextForCausalLM

        self.torch = torch
        self.model = Qwen3NextForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()

    def next_logprobs(self, tokens: list[int]):
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([tokens])).logits[0, -1]
        return logits.float().log_softmax(-1)


def arbitrate(model: TransformersModel, request: str, prompt: list[int], stream: list[int],
              reference: list[int], tie: float = TIE) -> Verdict | None:
    """The verdict at the first position where ``stream`` and ``reference`` differ; None where they do not."""
    position = first_difference(stream, reference)
    if position is None:
        return None
    lp = model.next_logprobs(list(prompt) + list(stream[:position]))
    s, r = stream[position], reference[position]
    return Verdict(request=request, position=position, stream_token=s, reference_token=r,
                   top_token=int(lp.argmax()), stream_logprob=round(float(lp[s]), 4),
                   reference_logprob=round(float(lp[r]), 4), top_logprob=round(float(lp.max()), 4),
                   reference_rank=int((lp > lp[r]).sum()), side=side_of(lp, s, r, tie))


def _cases_from_summary(path: str, key: str, run: str) -> list[tuple[str, list[int], list[int], list[int]]]:
    summary = json.loads(Path(path).read_text())
    if key:
        summary = summary[key]
    outputs = summary["runs"][run].get("mismatched_outputs")
    if outputs is None:
        raise SystemExit(f"{path}: runs.{run} keeps no mismatched_outputs (recorded before the fuzz kept "
                         "them); pass one case with --prompt/--stream/--reference")
    return [(rid, o["prompt"], o["stream"], o["reference"]) for rid, o in outputs.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", required=True, help="the tiny checkpoint's kind (harness.tiny_checkpoints)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype (the weights are bf16 values either way; float32 is nearer vLLM's CPU engine)")
    ap.add_argument("--tie", type=float, default=TIE)
    ap.add_argument("--summary", help="a fuzz summary JSON with runs.<run>.mismatched_outputs")
    ap.add_argument("--key", default="", help="the summary's key inside that JSON (e.g. mtp)")
    ap.add_argument("--run", default="off", help="which stream's mismatches (off, on, ...)")
    ap.add_argument("--request", default="request")
    ap.add_argument("--prompt", help="comma-separated prompt token ids")
    ap.add_argument("--stream", help="comma-separated tokens the stream gave (up to and including the first difference)")
    ap.add_argument("--reference", help="comma-separated tokens the reference gave")
    ap.add_argument("--out", help="write the verdicts as JSON here")
    args = ap.parse_args(argv)

    def ids(text: str) -> list[int]:
        return [int(t) for t in text.split(",") if t.strip()]

    if args.summary:
        cases = _cases_from_summary(args.summary, args.key, args.run)
    elif args.prompt and args.stream and args.reference:
        cases = [(args.request, ids(args.prompt), ids(args.stream), ids(args.reference))]
    else:
        ap.error("give --summary, or --prompt with --stream and --reference")
    model = TransformersModel(args.kind, args.seed, args.dtype)
    verdicts = [v for case in cases if (v := arbitrate(model, *case, tie=args.tie)) is not None]
    print(f"Transformers ({args.dtype}, CPU) on {args.kind} seed {args.seed}: the position where stream "
          "and reference part\n")
    print("| request | position | stream | reference | Transformers' top | logprob stream / reference / top "
          "| reference's rank | side |")
    print("|---|---|---|---|---|---|---|---|")
    for v in verdicts:
        print(f"| {v.request} | #{v.position} | {v.stream_token} | {v.reference_token} | {v.top_token} | "
              f"{v.stream_logprob:.3f} / {v.reference_logprob:.3f} / {v.top_logprob:.3f} | {v.reference_rank} "
              f"| {v.side} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(kind=args.kind, seed=args.seed, dtype=args.dtype, tie=args.tie,
                                                  command=" ".join(sys.argv),
                                                  verdicts=[asdict(v) for v in verdicts]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
