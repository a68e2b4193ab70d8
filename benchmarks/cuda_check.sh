#!/usr/bin/env bash
# The CUDA checks of issue 5 in one run (needs a GPU and the project installed):
#   1. a recorded training step under torch.cuda.set_sync_debug_mode("error") (tests/test_sync.py -m cuda)
#   2. the overhead benchmark on the GPU (--quick), GPU name printed by the script
#   3. kernel launches of the fused torch-op statistics per batch (target <= 3), results vs the CPU
#   4. the staged rows (a CUDA run's per-tensor path) on CUDA against the cast oracle
# The C++ kernel is built first (a CUDA run uses its staging copy), so the overhead is the steady state.
# Usage: bash benchmarks/cuda_check.sh [output dir]   (default: $OUT or ./cuda_check)
set -u
out="${1:-${OUT:-cuda_check}}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
date -u | tee -a "$out/gpu.txt"
mpscope build-kernel 2>&1 | tee "$out/build_kernel.txt"
python -m pytest tests/test_sync.py -m cuda -q -rs 2>&1 | tee "$out/test_sync_cuda.txt"
python benchmarks/overhead.py --device cuda --quick 2>&1 | tee "$out/overhead_cuda.txt"
python benchmarks/stats_launches.py 2>&1 | tee "$out/stats_launches_cuda.txt"
python -m pytest tests/test_staged_rows.py -q -rs 2>&1 | tee "$out/staged_rows_cuda.txt"
