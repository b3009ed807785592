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
  if [ ! -x "$VENV/bin/python" ] && [ ! -L "$VENV" ] && cached_venv "$1"; then
    return 0
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    py=$(find_python)
    echo "==> creating $VENV with $py"
    "$py" -m venv "$VENV"
  fi
  echo "==> installing megalaunch[$1] into $VENV (torch and megatron-core: a few GB the first time)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "${ROOT}[$1]"
}

# cached_venv EXTRAS: make .venv a link to a virtualenv shared by every checkout on this machine, built
# once per (pyproject.toml, extras, Python) under $MEGALAUNCH_VENV_CACHE (default ~/.cache/megalaunch/venvs;
# "off" turns it off), so a fresh clone re-installs only megalaunch itself (seconds, not the minutes
# torch and megatron-core take). Only for the default .venv; returns 1 when not used.
cached_venv() {
  local cache_root=${MEGALAUNCH_VENV_CACHE:-$HOME/.cache/megalaunch/venvs} py key dir
  [ "$cache_root" != off ] && [ -z "${MEGALAUNCH_VENV:-}" ] || return 1
  py=$(find_python) || return 1
  key=$( { cat "$ROOT/pyproject.toml"; echo "extras=$1"; "$py" -VV; } | sha256sum | cut -c1-16)
  dir=$cache_root/$key
  if [ ! -f "$dir/.complete" ]; then
    echo "==> building the shared virtualenv $dir (megalaunch[$1]; torch and megatron-core: a few GB)"
    rm -rf "$dir"
    mkdir -p "$cache_root"
    "$py" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q -e "${ROOT}[$1]"
    touch "$dir/.complete"
  fi
  ln -sfn "$dir" "$VENV"
  echo "==> $VENV -> $dir (shared virtualenv for megalaunch[$1]); installing this checkout into it"
  # the editable install points the shared environment at this checkout's sources
  editable_install "$VENV"
}

# editable_install VENV: point VENV's megalaunch at this checkout; without build isolation where VENV has
# setuptools (pip's isolated build env re-installs setuptools every time: ~9 s against ~4 on the CI machine)
editable_install() {
  if "$1/bin/python" -c 'import setuptools' 2>/dev/null; then
    "$1/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  else
    "$1/bin/python" -m pip install -q --no-deps -e "$ROOT"
  fi
}

# core_venv DIR: a virtualenv with megalaunch's core install only (what a login node has: no torch, no
# click), plus pytest, for the CLI's own tests. Shared like the main one (cached_venv) under
# $MEGALAUNCH_VENV_CACHE, keyed by pyproject.toml and Python; DIR becomes a link to it (~22 CPU-s -> ~4).
core_venv() {
  local cache_root=${MEGALAUNCH_VENV_CACHE:-$HOME/.cache/megalaunch/venvs} py key dir
  py=$(find_python)
  if [ "$cache_root" = off ] || { [ -e "$1" ] && [ ! -L "$1" ]; }; then  # no cache, or a venv of the user's own
    [ -x "$1/bin/python" ] || "$py" -m venv "$1"
    "$1/bin/python" -m pip install -q -e "$ROOT" pytest pytest-timeout
    return 0
  fi
  key=$( { cat "$ROOT/pyproject.toml"; echo "core+pytest"; "$py" -VV; } | sha256sum | cut -c1-16)
  dir=$cache_root/core-$key
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    mkdir -p "$cache_root"
    "$py" -m venv "$dir"
    "$dir/bin/python" -m pip install -q -e "$ROOT" pytest pytest-timeout setuptools
    touch "$dir/.complete"
  fi
  ln -sfn "$dir" "$1"
  editable_install "$1"
}
