#!/usr/bin/env bash
# Makes the virtual environment .venv (Python 3.11) with the pinned packages of
# python/requirements.txt (PyTorch 2.13.0, transformers, peft, pytest, ...) and
# strata itself: a path file puts build/python, the package scripts/build.sh
# builds, on its import path. Idempotent: installs again only when
# python/requirements.txt changed. pip takes torch 2.13.0's CPU build from the
# wheels this machine's pip configuration points at (elsewhere, PyPI's torch is
# a CUDA build of several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
  python=$(command -v python3.11 || true)
  if [ -z "$python" ]; then
    echo "venv: no python3.11 on PATH: strata's pinned PyTorch (2.13.0) is the build for Python 3.11;" \
         "install it (Debian: python3.11 python3.11-venv python3.11-dev) and run again" >&2
    exit 1
  fi
  "$python" -m venv "$venv"
fi
stamp="$venv/.strata-requirements"
if ! cmp -s python/requirements.txt "$stamp"; then
  echo "venv: installing python/requirements.txt into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r python/requirements.txt 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored" || true; }
  cp python/requirements.txt "$stamp"
fi
# NCCL: the toolkit's, else PyPI's wheel (python/requirements-nccl.txt), which CMake finds in .venv.
nccl_stamp="$venv/.strata-requirements-nccl"
if [ -x /usr/local/cuda/bin/nvcc ] && [ ! -e /usr/local/cuda/include/nccl.h ] && \
   ! cmp -s python/requirements-nccl.txt "$nccl_stamp"; then
  echo "venv: no NCCL in /usr/local/cuda: installing python/requirements-nccl.txt into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r python/requirements-nccl.txt 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored" || true; }
  cp python/requirements-nccl.txt "$nccl_stamp"
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/build/python" > "$site/strata-build.pth"
