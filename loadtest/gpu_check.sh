#!/usr/bin/env bash
# The native engine's check on a GPU machine (one H100/H200, torch and triton installed, nothing
# downloadable): tests/gpu, then the benchmarks BENCHMARKS.md records for it, each stage under
# its own time limit so that the whole ends within 8 minutes. Run from the repository root:
#
#   bash loadtest/gpu_check.sh [OUT_DIR]
#
# Packages the machine lacks travel as wheels in .whl/ (gguf, llguidance: see BENCHMARKS.md,
# "The engine on a GPU"); they are installed into /tmp/site first. Stages write under a scratch
# folder; OUT_DIR (default: $OUT, else bench-out/gpu-check) gets at most 8 files (what the
# device tool brings back): summary.txt with every stage's exit and last lines, the tests' log,
# the two bench reports, the 64-prompt engine log (its start-up lines) and the two profiles. A
# failing stage does not stop the next.
set -uo pipefail
out=${1:-${OUT:-bench-out/gpu-check}}
work=$(mktemp -d /tmp/gpu-check.XXXXXX)
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
    timeout "$limit" "$@" > "$work/$name.log" 2>&1
    local rc=$?
    {
        echo "== $name: exit $rc in $((SECONDS - start)) s"
        tail -n 4 "$work/$name.log"
    } | tee -a "$out/summary.txt"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
    lscpu | grep -m1 "Model name"
} | tee "$out/summary.txt"

stage tests-gpu 150 python3 -m pytest -q -p no:cacheprovider tests/gpu
stage make-models 45 bash -c "python3 -m loadtest.bench.engine --make-tiny-model /tmp/smol --shape smollm2-135m && python3 -m loadtest.bench.engine --make-tiny-model /tmp/llama3-8b --shape llama3-8b"
common=(--model /tmp/smol --device cuda --threads 16)
stage bench-64 90 python3 -m loadtest.bench.engine "${common[@]}" --systems splitserve,transformers --out "$work/engine-64"
stage bench-256 75 python3 -m loadtest.bench.engine "${common[@]}" --systems splitserve,transformers --num-prompts 256 --max-num-seqs 256 --hf-batch-size 64 --out "$work/engine-256"
stage profile-64 40 python3 -m loadtest.bench.profile_engine --model /tmp/smol --device cuda --threads 16
stage profile-llama3-8b-256 80 python3 -m loadtest.bench.profile_engine --model /tmp/llama3-8b --load-format dummy --device cuda --threads 16 --num-prompts 256 --max-num-seqs 256 --output-tokens 64
cp "$work/tests-gpu.log" "$work/profile-64.log" "$work/profile-llama3-8b-256.log" "$out/"
cp "$work/engine-64/report.md" "$out/engine-64.md"
cp "$work/engine-256/report.md" "$out/engine-256.md"
cp "$work/engine-64/splitserve.log" "$out/engine-64-splitserve.log"
grep "^== " "$out/summary.txt"
