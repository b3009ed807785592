# shellcheck shell=bash
# Shared by scripts/demo and scripts/test: find Python 3.12 and make the project's virtualenv.
# megatron-core >= 0.17 needs Python >= 3.12 (on 3.11 pip silently falls back to 0.16).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MEGALAUNCH_VENV:-$ROOT/.venv}

find_python() {
  local c
  for c in "${MEGALAUNCH_PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"
      return 0
    fi
  done
  echo "megalaunch: Python 3.12 not found (megatron-core needs it); install it (e.g. pyenv install 3.12) or set MEGALAUNCH_PYTHON" >&2
  return 1
}

make_venv() {  # $1: extras, e.g. "train" or "dev,train,tokenize,convert"
  local py
  if [ ! -x "$VENV/bin/python" ]; then
    py=$(find_python)
    echo "==> creating $VENV with $py"
    "$py" -m venv "$VENV"
  fi
  echo "==> installing megalaunch[$1] into $VENV (torch and megatron-core: a few GB the first time)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "${ROOT}[$1]"
}
