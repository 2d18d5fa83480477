"""How many of the scenario's R1 and R2 vLLM's scheduler admits at once in a tiny MTP engine with BLOCKS KV blocks.

    python tests/vllm/mtp_admission.py MODEL BLOCKS K    # prints {"admitted": N, "vllm": VERSION}

Run in a fresh process. The engine (CPU, engine core in this process) is built and its scheduler
asked for one step; nothing runs the model, which the CPU backend cannot do with speculative
decoding. For ``harness.fuzz.mtp_blocks`` (``test_fuzz.py``).
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process


def main() -> None:
    model, blocks, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import vllm
    from vllm import SamplingParams

    from gdn_pass.vllm.checker.scenarios import R1_PROMPT, R2_PROMPT, R2_TOKENS, make_llm

    llm = make_llm(model, guard=False, compile=False, num_gpu_blocks_override=blocks,
                   speculative_config={"method": "mtp", "num_speculative_tokens": k})
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=R2_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("R1", {"prompt_token_ids": R1_PROMPT}, params)
    engine.add_request("R2", {"prompt_token_ids": R2_PROMPT}, params)
    scheduler = engine.engine_core.engine_core.scheduler
    print(json.dumps({"admitted": len(scheduler.schedule().scheduled_new_reqs), "vllm": vllm.__version__}), flush=True)


if __name__ == "__main__":
    main()
