#!/usr/bin/env bash
# Which condition breaks tests/gpu/test_cuda_graph_replay.py on the H200? It passed
# alone (no vLLM on the path) at b9a5792-65f40b5 and fails whenever vLLM's bundle is
# on the path and the same pytest process collected vLLM tests (illegal memory
# access in an Inductor autotune benchmark; history rows off by ~1e-8). One device
# call, four processes, two at a time (one per GPU), vLLM 0.26 bundle unpacked:
#   plain          PYTHONPATH=$PWD only: vLLM not importable
#   site_path      the bundle on the path, vLLM never imported
#   vllm_imported  the same, `import vllm` first (pytest -p vllm): vLLM's env_override
#   vllm_conftest  the same, tests/vllm collected too (its conftest turns caches off)
# and, in a process of its own, tests/gpu/test_stage_rows_cuda.py (the fused staging,
# which has so far only run after this failure in the same process).
# Logs land in $OUT/replay_<name>.log.
#
#   bash benchmarks/gpu_replay_ab.sh
set -u
test=(tests/gpu/test_cuda_graph_replay.py -k "poison_oracle and torch")
site=$PWD:/tmp/site:/tmp/site-project
run() {
    local name=$1 gpu=$2 path=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$path VLLM_USE_FLASHINFER_SAMPLER=0 timeout 280 \
        python3 -m pytest -q -p no:cacheprovider -p no:logging "$@" > "$OUT/replay_$name.log" 2>&1
    echo "$name: exit $? | $(tail -1 "$OUT/replay_$name.log")"
}
run plain 0 "$PWD" "${test[@]}" & run site_path 1 "$site" "${test[@]}" & wait
run vllm_imported 0 "$site" -p vllm "${test[@]}" & run vllm_conftest 1 "$site" "${test[@]}" tests/vllm/test_compat.py & wait
run stage_rows 0 "$PWD" tests/gpu/test_stage_rows_cuda.py
grep -h "illegal memory\|not bitwise" "$OUT"/replay_*.log | sort | uniq -c | head
