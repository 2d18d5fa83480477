#!/usr/bin/env bash
# Issue 14's GPU measurements in one device call on nvidia-h200-x2 (vLLM 0.26
# bundle already unpacked: ../shared/gpu-vllm/README.md):
#   GPU 0: benchmarks/engine_cost.py, Qwen3-Next-80B layer dimensions, LAYERS layers
#          (both engines on the one GPU, measured in turn); PART is "steps" (the step
#          cases, rounds while the time budget lasts), "stream" (the serving-like
#          stream alone) or "both" (one step round, one stream round, then step rounds while the budget lasts): engine
#          start takes about 190-215 s, so one call does one part.
#   GPU 1: benchmarks/gated_read_overhead.py on the FLA layer at B=256, three runs
#          (needs .whl/ carried with fla-core and einops wheels).
#   GPU 1, then: GPU1_TESTS (optional), `scripts/test-gpu` arguments run there with
#          vLLM's GPU tests limited to GDN_PASS_GPU_MODES=default. They share the
#          host with engine_cost, so the costs of a call that uses them are not
#          valid (engine_cost_gpu_run3.md): use it only for a call whose timings
#          do not count.
# Everything lands in $OUT: engine_cost_<PART>.{json,md,log}, gated_read_overhead.tgz,
# gpu_tests.log and gpu_tests/ (GPU1_TESTS).
#
# ENGINE_COST_ARGS (optional): more engine_cost.py arguments, e.g. "--profile 8:4".
#
#   [GPU1_TESTS="tests/gpu/..."] [ENGINE_COST_ARGS=...] bash benchmarks/gpu_cost_round.sh PART [LAYERS] [TIME_BUDGET_S]
set -u
part=$1 layers=${2:-12} budget=${3:-440}
export PYTHONPATH=$PWD:/tmp/site:/tmp/site-project VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/fla_core-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-fla .whl/*.whl
    (
        for i in 1 2 3; do
            CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PYTHONPATH:/tmp/site-fla python3 benchmarks/gated_read_overhead.py \
                --models fla --batches 256 --rounds 9 --out /tmp/gro/run$i
        done > /tmp/gro.log 2>&1
    ) &
fi
if [ -n "${GPU1_TESTS:-}" ]; then
    (
        CUDA_VISIBLE_DEVICES=1 GDN_PASS_GPU_RESULTS=$OUT/gpu_tests GDN_PASS_GPU_MODES=default \
            bash scripts/test-gpu -q -p no:logging $GPU1_TESTS > "$OUT/gpu_tests.log" 2>&1
        echo "gpu tests exit $?" >> "$OUT/gpu_tests.log"
    ) &
fi
case $part in
    steps) what=(--rounds 9 --stream-rounds 0) ;;
    stream) what=(--rounds 0 --stream-rounds 3) ;;
    both) what=(--rounds 9 --stream-rounds 1) ;;
    *) echo "PART is steps, stream or both" >&2; exit 2 ;;
esac
CUDA_VISIBLE_DEVICES=0 timeout $((budget + 120)) python3 benchmarks/engine_cost.py --dims qwen3-next-80b \
    --layers "$layers" --gpu "${what[@]}" ${ENGINE_COST_ARGS:-} --time-budget "$budget" --workdir /tmp/ec --out "$OUT" \
    --name "engine_cost_$part" > "$OUT/engine_cost_$part.log" 2>&1
echo "engine_cost exit $?"
wait
tail -3 "$OUT/gpu_tests.log" 2>/dev/null
grep -h "| fla | 256" /tmp/gro/run*/gated_read_overhead.md 2>/dev/null
[ -d /tmp/gro ] && tar czf "$OUT/gated_read_overhead.tgz" -C /tmp gro gro.log
cat "$OUT/engine_cost_$part.md" 2>/dev/null
grep -E "started in|fresh-row|profiled|round|stream done|budget|Error" "$OUT/engine_cost_$part.log" | cut -c1-300
