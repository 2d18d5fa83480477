#!/usr/bin/env bash
# The metadata hook's staging and the zeroing launch on the H200, in one device call
# (vLLM 0.26 bundle already unpacked: ../shared/gpu-vllm/README.md):
#   GPU 0: benchmarks/zero_rows_bandwidth.py (ZERO_BANDWIDTH=1 only: the zeroing grid
#          against the previous one), then the CUDA staging / zeroing / capture tests,
#          then the zeroing tests on a copy with a broken guard (it must fail): the zeroing
#          kernel picks the wrong row.
#   GPU 1: tests/gpu/test_vllm_e2e.py in modes default and full (the pass on vs the
#          prompts run alone in fresh engines, pass off diverges). On a one-GPU
#          machine (nvidia-h200) they run on GPU 0 after the tests above.
#   GPU 0, last: benchmarks/hook_host_time.py (HOOK_TIME=0 skips it): the hook's host
#          time per build, real GDN builder on CUDA.
#          On a two-GPU machine it shares the host with the e2e engines, so its
#          absolute microseconds are upper bounds (its ratios are interleaved).
# Everything lands in $OUT.
#
#   [ZERO_BANDWIDTH=1] [HOOK_TIME=0] bash benchmarks/gpu_hook_round.sh
set -u
export PYTHONPATH=$PWD:/tmp/site:/tmp/site-project VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
e2e() {
    CUDA_VISIBLE_DEVICES=$1 GDN_PASS_GPU_RESULTS=$OUT/gpu_tests GDN_PASS_GPU_MODES=default,full timeout 380 \
        bash scripts/test-gpu -q -p no:logging tests/gpu/test_vllm_e2e.py > "$OUT/e2e.log" 2>&1
    echo "e2e exit $?" >> "$OUT/e2e.log"
}
one_gpu=$([ "$(nvidia-smi -L | wc -l)" -lt 2 ] && echo 1)
[ -z "$one_gpu" ] && e2e 1 &
if [ "${ZERO_BANDWIDTH:-0}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/zero_rows_bandwidth.py --out "$OUT/zero" > "$OUT/zero.log" 2>&1
    echo "zero_rows_bandwidth exit $?"
fi
units=(tests/gpu/test_stage_rows_cuda.py tests/gpu/test_zero_rows_all.py tests/gpu/test_zero_rows_capture.py)
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider "${units[@]}" \
    > "$OUT/cuda_units.log" 2>&1
echo "cuda units exit $? | $(tail -1 "$OUT/cuda_units.log")"
broken=/tmp/broken-guard
rm -rf $broken && mkdir -p $broken && cp -r gdn_pass inductor_ext tests pyproject.toml $broken/
sed -i 's/(rank == k + 1)/(rank == k)/' $broken/gdn_pass/vllm/_zero_kernels.py
(cd $broken && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$broken timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_zero_rows_all.py \
    > "$OUT/cuda_units_broken.log" 2>&1)
echo "broken guard (must fail): exit $? | $(grep -cE '^FAILED' "$OUT/cuda_units_broken.log") failed | $(tail -1 "$OUT/cuda_units_broken.log")"
grep -E "^FAILED" "$OUT/cuda_units_broken.log" | cut -c1-160
[ -n "$one_gpu" ] && e2e 0
if [ "${HOOK_TIME:-1}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/hook_host_time.py --out "$OUT/hook" > "$OUT/hook.log" 2>&1
    echo "hook_host_time exit $?"
fi
wait
grep -h "^|" "$OUT/zero.log" "$OUT/hook.log" 2>/dev/null
tail -4 "$OUT/e2e.log"
