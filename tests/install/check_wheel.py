"""The pip package as a user gets it: `pip wheel .` builds strata's wheel, a new virtual environment
outside the tree installs it, and from outside the tree that environment's Python runs the short
fine-tune (examples/finetune.py --short) and its bin/ the `strata` command.

    python tests/install/check_wheel.py --build-dir build/pip-wheel

Run with the Python of .venv (scripts/venv.sh). The wheel's dependencies are not installed again:
the wheel goes in with --no-deps, and a path file puts this Python's site-packages (torch, numpy,
matplotlib, ...) behind the new environment's own, so that torch, several GB, is not copied. That
path file is not a site directory: .venv's own path files (its strata-build.pth) are not read, and
strata is imported from the wheel, which this script checks.

The C++ build reuses what it can: --build-dir keeps CMake's build folder between runs, so that only
what changed is compiled again, and ccache, where installed, keeps the objects (CMakeLists.txt). pip
builds in an isolated environment, as for a user, with scikit-build-core and pybind11 from the
package index; the module compiles against this Python's pybind11 (pybind11_DIR), whose headers stay
where they are, where the isolated environment's are in a new folder each time. Exit status 0 and a
summary on success; 1 and what failed otherwise.
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CheckFailed(Exception):
    pass


def run(what, command, **kwargs):
    """Runs `command`; its output when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise CheckFailed(f"{what} failed (exit {done.returncode}): {' '.join(command)}\n{done.stdout}{done.stderr}")
    return done.stdout


def build_wheel(work, build_dir):
    wheels = os.path.join(work, "wheels")
    command = [sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--wheel-dir", wheels,
               "--config-settings", f"build-dir={build_dir}"]
    if importlib.util.find_spec("pybind11"):
        import pybind11
        command += ["--config-settings", f"cmake.define.pybind11_DIR={pybind11.get_cmake_dir()}"]
    start = time.monotonic()
    run("pip wheel", command)
    seconds = time.monotonic() - start
    (name,) = os.listdir(wheels)
    return os.path.join(wheels, name), seconds


def make_environment(work):
    """A new virtual environment that sees this Python's packages behind its own; its python."""
    venv = os.path.join(work, "venv")
    run("python -m venv", [sys.executable, "-m", "venv", venv])
    python = os.path.join(venv, "bin", "python")
    site = run("reading its site-packages", [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    ours = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    with open(os.path.join(site.strip(), "strata-test-deps.pth"), "w") as f:
        f.write("".join(path + "\n" for path in sorted(ours)))
    return venv, python


def check_installed(venv, python, work, env):
    """strata imported from the environment, at the version `strata version` prints; the version."""
    probe = "import importlib.metadata, strata; print(strata.__file__); print(strata.__version__); " \
            "print(importlib.metadata.version('strata'))"
    where, version, metadata_version = run("import strata", [python, "-c", probe], cwd=work, env=env).split()
    if not where.startswith(venv + os.sep):
        raise CheckFailed(f"strata was imported from {where}, not from the wheel installed in {venv}")
    if version != metadata_version:
        raise CheckFailed(f"strata.__version__ is {version}, the package's metadata says {metadata_version}")
    printed = run("strata version", [os.path.join(venv, "bin", "strata"), "version"], cwd=work, env=env)
    if not printed.startswith(f"strata {version} "):
        raise CheckFailed(f"`strata version` printed {printed!r}, expected strata {version}")
    return printed.strip()


def check_finetune(python, work, env):
    """The short fine-tune from outside the tree; its losses against plain PyTorch's."""
    out = os.path.join(work, "finetune")
    run("examples/finetune.py --short",
        [python, os.path.join(ROOT, "examples", "finetune.py"), "--short", "--no-progress", "--out", out],
        cwd=work, env=env, timeout=600)
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    losses, baseline = report["loss"], report["baseline_loss"]
    if len(losses) != 6 or not 0 < len(baseline) <= len(losses):
        raise CheckFailed(f"the fine-tune's report has {len(losses)} losses (expected 6) "
                          f"and {len(baseline)} baseline ones")
    for ours, theirs in zip(losses, baseline):
        if abs(ours - theirs) > 1e-5 * abs(theirs):
            raise CheckFailed(f"the installed strata's losses {losses} differ from plain PyTorch's {baseline}")
    return losses


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", required=True, help="CMake's build folder for the wheel, kept between runs")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="strata-wheel-")
    try:
        if os.path.realpath(work).startswith(os.path.realpath(ROOT) + os.sep):
            raise CheckFailed(f"the temporary folder {work} is inside the tree; set TMPDIR elsewhere")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        wheel, seconds = build_wheel(work, os.path.abspath(args.build_dir))
        built = f"{os.path.basename(wheel)} ({os.path.getsize(wheel) / 2**20:.1f} MiB) built in {seconds:.0f} s"
        venv, python = make_environment(work)
        run("pip install the wheel", [python, "-m", "pip", "install", "--no-deps", "--no-index", wheel], env=env)
        version = check_installed(venv, python, work, env)
        losses = check_finetune(python, work, env)
    except (CheckFailed, OSError, subprocess.TimeoutExpired) as e:
        print(f"check_wheel: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"check_wheel: {built}; installed in a new environment: {version}; "
          f"the short fine-tune's losses {losses[0]:.4f} .. {losses[-1]:.4f}, those of plain PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
