#!/usr/bin/env bash
# The native engine's check on a GPU machine (one H100/H200, torch and triton installed, nothing
# downloadable): tests/gpu, then the benchmarks BENCHMARKS.md records for it, each stage under
# its own time limit so that the whole ends within 8 minutes. Run from the repository root:
#
#   bash loadtest/gpu_check.sh [OUT_DIR]
#
# Packages the machine lacks travel as wheels in .whl/ (gguf, llguidance: see BENCHMARKS.md,
# "The engine on a GPU"); they are installed into /tmp/site first. Every stage's log lands in
# OUT_DIR (default: $OUT, else bench-out/gpu-check); a failing stage does not stop the next.
set -uo pipefail
out=${1:-${OUT:-bench-out/gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

stage() {  # stage NAME SECONDS CMD...: run CMD with a time limit, its output to NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
    tail -n 4 "$out/$name.log"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
    lscpu | grep -m1 "Model name"
} | tee "$out/summary.txt"

stage tests-gpu 120 python3 -m pytest -q -p no:cacheprovider tests/gpu
stage make-models 50 bash -c "python3 -m loadtest.bench.engine --make-tiny-model /tmp/smol --shape smollm2-135m && python3 -m loadtest.bench.engine --make-tiny-model /tmp/llama3-8b --shape llama3-8b"
common=(--model /tmp/smol --device cuda --threads 16)
stage bench-64 90 python3 -m loadtest.bench.engine "${common[@]}" --systems splitserve,transformers --out "$out/engine-64"
stage bench-256 80 python3 -m loadtest.bench.engine "${common[@]}" --systems splitserve,transformers --num-prompts 256 --max-num-seqs 256 --hf-batch-size 64 --out "$out/engine-256"
stage profile-64 50 python3 -m loadtest.bench.profile_engine --model /tmp/smol --device cuda --threads 16
stage profile-llama3-8b-256 80 python3 -m loadtest.bench.profile_engine --model /tmp/llama3-8b --load-format dummy --device cuda --threads 16 --num-prompts 256 --max-num-seqs 256 --output-tokens 64
cat "$out/summary.txt"
