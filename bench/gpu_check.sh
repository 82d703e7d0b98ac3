#!/usr/bin/env bash
# The GPU check in one go, on a machine with an NVIDIA GPU and driver:
#   1. a venv with edgekv[cuda*,test] (the toolkit wheels matching the driver's CUDA major version)
#   2. every GPU kernel compiled for this GPU, then the GPU test suite on the hardware
#      (tests/gpu/sim_*.py without the simulator, and tests/test_gpu.py)
#   3. generation on --device cuda with both real models and a 7B synthetic model: decode
#      tokens/s, the share of the GPU's memory bandwidth, agreement with the CPU backend
# Results: printed, and appended as JSON lines to bench/gpu_results.jsonl.
# Env: PYTHON (default python3), VENV (default .venv-gpu), SYNTH_DIR (default ~/.cache/edgekv),
#      TOKENS (default 128).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null || { echo "gpu_check: nvidia-smi not found: no NVIDIA driver here" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv

VENV=${VENV:-.venv-gpu}
[ -d "$VENV" ] || "${PYTHON:-python3}" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
case "${cuda_major:-0}" in
  12) extra=cuda12 ;;
  1[3-9]) extra=cuda13 ;;
  *) extra=cuda ;;  # an older driver: numba-cuda with the system's toolkit
esac
echo "== installing edgekv[$extra,test] (driver CUDA ${cuda_major:-unknown})"
pip install -q -e ".[$extra,test]"

cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')
echo "== every kernel compiled for sm_${cc/./}"
python bench/gpu_ptx_check.py --cc "$cc"

echo "== GPU tests on the hardware"
EDGEKV_GPU_REAL=1 python -m pytest -q -p no:cacheprovider -o python_files='sim_*.py' tests/gpu
python -m pytest -q -p no:cacheprovider tests/test_gpu.py

SYNTH_DIR=${SYNTH_DIR:-$HOME/.cache/edgekv}
SYN="$SYNTH_DIR/synth-llama-7b-q4_0.gguf"
mkdir -p "$SYNTH_DIR"
[ -f "$SYN" ] || edgekv synth --arch llama --size 7b --type q4_0 "$SYN"

echo "== generation on --device cuda (and the CPU backend for agreement)"
edgekv run smollm2-135m-instruct "The capital of France is" -n 16 --device cuda --temp 0
python bench/gpu_measure.py smollm2-135m-instruct gemma3-270m "$SYN" --tokens "${TOKENS:-128}" \
  --cpu-tokens 32 --json bench/gpu_results.jsonl
echo "gpu_check: done; figures in bench/gpu_results.jsonl"
