#!/usr/bin/env bash
# The main job on its default settings: installs what is needed, builds into
# build/, and runs `strata selftest`, which pushes a GPT-style set of tensors
# through device, host and NVMe under small budgets and verifies every byte.
# Extra arguments go to `strata selftest` (see `build/bin/strata selftest --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh build
nvme_dir=${STRATA_NVME_DIR:-build/selftest-nvme}
mkdir -p "$nvme_dir"
exec build/bin/strata selftest --nvme-dir "$nvme_dir" --json build/selftest.json "$@"
