#!/usr/bin/env bash
# The main job on its default settings: installs what is needed, builds into
# build/, and fine-tunes a GPT-style decoder (examples/finetune.py) whose
# states do not fit the device and host budgets: device, host and NVMe (under
# build/demo/nvme) all hold some. Then the same model trains with plain
# PyTorch for comparison; build/demo/ gets report.json, memory.png, loss.png.
# Extra arguments go to examples/finetune.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/venv.sh   # .venv: PyTorch 2.13 and the other pinned Python packages; strata from build/python
scripts/build.sh build
exec .venv/bin/python examples/finetune.py --out build/demo "$@"
