"""scripts/check_layers.py: the tree passes; a planted upward, private or foreign include fails."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_layers.py"


def run(root):
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True)


@pytest.fixture
def tree(tmp_path):
    for folder in ["include", "src", "memory", "optim", "offload", "benchmarks", "tools", "python/src"]:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return tmp_path


def plant(tree, path, line):
    with open(tree / path, "a") as file:
        file.write(line + "\n")


def test_the_tree_keeps_its_layers():
    result = run(ROOT)
    assert result.returncode == 0, result.stdout
    assert "every include within its layer" in result.stdout


@pytest.mark.parametrize("path, line, complaint", [
    ("src/base/status.cc", '#include "memory/residency.h"', "in layer memory, above or beside base"),
    ("memory/engine.cc", '#include "offload/schedule/pipeline.h"', "in layer schedule, above or beside memory"),
    ("optim/optimizer.cc", '#include "strata/engine.h"', "in layer memory, above or beside optim"),
    ("src/backends/comm/comm.cc", '#include "src/backends/storage/storage_util.h"', "private to src/backends/storage/"),
    ("memory/residency.cc", "#include <liburing.h>", "belongs to a backend"),
    ("include/strata/engine.h", '#include "memory/residency.h"', "the public API includes only strata/ headers"),
])
def test_a_planted_include_against_the_table_fails(tree, path, line, complaint):
    assert run(tree).returncode == 0
    plant(tree, path, line)
    result = run(tree)
    assert result.returncode == 1
    assert f"{path}:" in result.stdout and complaint in result.stdout, result.stdout
