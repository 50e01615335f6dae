#!/usr/bin/env bash
# CI: compile every racecpu.cuda kernel to PTX for sm_80 and sm_90 (float32 and float64)
# with the real NVVM compiler, no GPU needed, so a typing error in racecpu.cuda fails CI
# instead of reaching a GPU user.  numba-cuda (0.30, CUDA 13 bindings) finds NVVM/NVRTC in
# the NVIDIA pip wheels below (through cuda-pathfinder); no CUDA_HOME or driver is needed.
# RACECPU_REQUIRE_PTX=1 turns the test's "compiler not installed" skip into a failure.
# Called from .ci/run after the test extras are installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install "numba-cuda>=0.30" "cuda-toolkit[nvvm,nvrtc,cudart]==13.*"
RACECPU_REQUIRE_PTX=1 python -m pytest -q tests/test_cuda.py::test_kernels_compile_to_ptx
