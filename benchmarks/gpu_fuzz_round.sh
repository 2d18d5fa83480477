#!/usr/bin/env bash
# GPU fuzz runs side by side in one device call (vLLM 0.26 bundle already
# unpacked: ../shared/gpu-vllm/README.md). Each line of the jobs file is one
# `fuzz_scheduling.py --gpu` argument list, optionally preceded by VAR=value
# settings for that job alone (e.g. GDN_FUZZ_MUTATION=skip_zeroing); every job
# gets its own workdir. REFERENCE_DIR (optional): reference_<config>.json files
# copied into every workdir first, so that jobs reuse references already run.
# Results (.md/.json) go to $OUT/results.tgz; each job's engine logs and raw
# streams to $OUT/raw_<job>.tgz (a device call returns at most 8 files of
# 16 MiB: at most 7 jobs, fewer with --trace-detail's larger streams).
#
#   bash benchmarks/gpu_fuzz_round.sh JOBS_FILE SECONDS
set -u
jobs_file=$1 limit=${2:-540}
export PYTHONPATH=$PWD:/tmp/site:/tmp/site-project VLLM_USE_FLASHINFER_SAMPLER=0 \
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
i=0
while read -r name args; do
    [ -z "$name" ] || [ "${name#\#}" != "$name" ] && continue
    settings=()
    set -- $args
    while [ $# -gt 0 ] && [[ $1 =~ ^[A-Z_][A-Z0-9_]*= ]]; do settings+=("$1"); shift; done
    args="$*"
    mkdir -p "/tmp/fz_$name"
    [ -n "${REFERENCE_DIR:-}" ] && cp "$REFERENCE_DIR"/reference_*.json "/tmp/fz_$name/"
    timeout "$limit" env ${settings[@]+"${settings[@]}"} python3 benchmarks/fuzz_scheduling.py --gpu $args --workdir "/tmp/fz_$name" \
        --out /tmp/fz_results --name "$name" > "/tmp/fz_$name.out" 2> "/tmp/fz_$name.err" &
    i=$((i + 1))
done < "$jobs_file"
wait
for f in /tmp/fz_*.err; do echo "== $f"; grep -E "FAILED|Traceback|Error" "$f" | head -5; done
grep -h "\[fuzz\]" /tmp/fz_*/*.log | tail -8
cat /tmp/fz_results/*.md | grep -E "^\| [a-z_]+ .*\| [0-9]|^Totals|^Not finished|^Failed" | cut -c1-600
tar czf "$OUT/results.tgz" -C /tmp fz_results
for d in /tmp/fz_*/; do
    job=$(basename "$d")
    [ "$job" = fz_results ] && continue
    tar czf "$OUT/raw_${job#fz_}.tgz" "/tmp/$job.err" "$d"*.log "$d"stream_*.json "$d"reference_*.json 2>/dev/null
done
ls -la "$OUT"
