#!/usr/bin/env bash
# GPU fuzz runs side by side in one device call (vLLM 0.26 bundle already
# unpacked: ../shared/gpu-vllm/README.md). Each line of the jobs file is one
# `fuzz_scheduling.py --gpu` argument list; every job gets its own workdir.
# Results (.md/.json) go to $OUT/results.tgz; every engine's log and the
# streams' raw outputs to $OUT/raw.tgz (a device call returns at most 8 files).
#
#   bash benchmarks/gpu_fuzz_round.sh JOBS_FILE SECONDS
set -u
jobs_file=$1 limit=${2:-540}
export PYTHONPATH=$PWD:/tmp/site:/tmp/site-project VLLM_USE_FLASHINFER_SAMPLER=0 \
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
i=0
while read -r name args; do
    [ -z "$name" ] || [ "${name#\#}" != "$name" ] && continue
    timeout "$limit" python3 benchmarks/fuzz_scheduling.py --gpu $args --workdir "/tmp/fz_$name" \
        --out /tmp/fz_results --name "$name" > "/tmp/fz_$name.out" 2> "/tmp/fz_$name.err" &
    i=$((i + 1))
done < "$jobs_file"
wait
for f in /tmp/fz_*.err; do echo "== $f"; grep -E "FAILED|Traceback|Error" "$f" | head -5; done
grep -h "\[fuzz\]" /tmp/fz_*/*.log | tail -8
cat /tmp/fz_results/*.md | grep -E "^\| [a-z_]+ .*\| [0-9]|^Totals|^Not finished|^Failed" | cut -c1-600
tar czf "$OUT/results.tgz" -C /tmp fz_results
tar czf "$OUT/raw.tgz" /tmp/fz_*.err /tmp/fz_*/*.log /tmp/fz_*/stream_*.json /tmp/fz_*/reference_*.json 2>/dev/null
ls -la "$OUT"
