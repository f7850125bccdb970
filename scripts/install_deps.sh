#!/usr/bin/env bash
# Installs what strata needs to build and test, from Debian packages (the
# Python packages, PyTorch among them, come from PyPI: scripts/venv.sh).
# Idempotent and non-interactive; run as root (or with sudo available).
# CUDA and NCCL are not installed here: they are used from /usr/local/cuda
# when present, and the build goes on without them otherwise.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libhwloc-dev libtbb-dev libisal-dev
  nlohmann-json3-dev libfmt-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  fio  # the reference of `strata bench io --compare-fio`
  python3-dev python3-venv  # the Python package's headers and its virtual environment (scripts/venv.sh)
  libopenmpi-dev openmpi-bin  # the MPI communicator and the multi-rank tests (mpirun)
  clang-14 libclang-rt-14-dev  # the fuzz targets' build: libFuzzer (scripts/fuzz.sh)
)

missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
