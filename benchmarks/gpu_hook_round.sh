#!/usr/bin/env bash
# The metadata hook on the H200 in one device call on nvidia-h200-x2 (vLLM 0.26
# bundle already unpacked: ../shared/gpu-vllm/README.md):
#   GPU 0: benchmarks/hook_host_time.py (the hook's host time per build, real GDN
#          builder on CUDA, pinned vs pageable flags copy), then the CUDA staging
#          and zeroing tests in a process without vLLM.
#   GPU 1: tests/gpu/test_vllm_e2e.py in modes default and full (the pass on vs the
#          prompts run alone in fresh engines, pass off diverges).
# Both share the host: hook_host_time's ratios are interleaved, its absolute
# microseconds are an upper bound. Everything lands in $OUT.
#
#   bash benchmarks/gpu_hook_round.sh
set -u
export PYTHONPATH=$PWD:/tmp/site:/tmp/site-project VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
(
    CUDA_VISIBLE_DEVICES=1 GDN_PASS_GPU_RESULTS=$OUT/gpu_tests GDN_PASS_GPU_MODES=default,full timeout 540 \
        bash scripts/test-gpu -q -p no:logging tests/gpu/test_vllm_e2e.py > "$OUT/e2e.log" 2>&1
    echo "e2e exit $?" >> "$OUT/e2e.log"
) &
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/hook_host_time.py --out "$OUT/hook" > "$OUT/hook.log" 2>&1
echo "hook_host_time exit $?"
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_stage_rows_cuda.py tests/gpu/test_zero_rows_all.py tests/gpu/test_zero_rows_capture.py \
    > "$OUT/cuda_units.log" 2>&1
echo "cuda units exit $? | $(tail -1 "$OUT/cuda_units.log")"
wait
grep "^|" "$OUT/hook.log"
tail -4 "$OUT/e2e.log"
