#!/usr/bin/env bash
# The vLLM engine on a GPU: install midflight and vLLM into .venv-gpu, build the tiny model, run
# the drill through `--engine vllm`, and exit with the drill's code. Extra arguments go to the
# drill (e.g. --rollouts 4). pip's own variables (PIP_NO_INDEX, PIP_FIND_LINKS) point it at a
# wheelhouse on a machine without the package registry. Writes under $WORK (default: a temp dir);
# with $OUT set (the device machine), the drill JSON and the run's logs are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.33.0
VENV=.venv-gpu
WORK="${WORK:-$(mktemp -d -t midflight-gpu-XXXXXX)}"
section() { printf '\n===== %s =====\n' "$1"; }

section "GPU"
nvidia-smi -L

section "install midflight and vllm==$VLLM_VERSION into $VENV"
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
# vLLM brings its own CUDA build of torch (and transformers, tokenizers): not constrained here.
if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "vllm==$VLLM_VERSION"; then
    echo "gpu-check: could not install vllm==$VLLM_VERSION (no package registry or wheelhouse here?)" >&2
    exit 3
fi

section "versions"
"$VENV/bin/python" - <<'EOF'
import sys
import torch
import vllm
print(f"python {sys.version.split()[0]}")
print(f"vllm {vllm.__version__}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, GPU seen: {torch.cuda.is_available()})")
EOF

section "tiny model"
"$VENV/bin/midflight" model tiny "$WORK/model"

section "drill --engine vllm"
status=0
"$VENV/bin/midflight" drill --engine vllm --model "$WORK/model" --keep-dir "$WORK/drill" --json "$@" \
    >"$WORK/drill.json" || status=$?
cat "$WORK/drill.json"
echo "drill exit code: $status (its files: $WORK/drill)"
if [[ -n "${OUT:-}" ]]; then
    cp "$WORK/drill.json" "$OUT/"
    tar -czf "$OUT/drill-logs.tar.gz" -C "$WORK" drill 2>/dev/null || true
fi
exit "$status"
