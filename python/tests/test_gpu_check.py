"""scripts/gpu_goals.py (the GPU goals table) on fabricated benchmark figures."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
GOALS = os.path.join(ROOT, "scripts", "gpu_goals.py")


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name, s_per_step, step_phase_s, predicted, **extra):
    return {name: {"s_per_step": s_per_step, "step_phase_s": step_phase_s, "predicted_step_s": predicted,
                   "bytes_per_step": {}, **extra}}


def _train_figures():
    results = {"plain": {"s_per_step": 0.15, "step_phase_s": 0.008}}
    results.update(_run("fits", 0.16, 0.01, 0.15))                   # 0.94x plain; plan 1.07: met, met
    results.update(_run("streamed", 0.98, 0.72, 0.5))                # plan 1.96: not met
    results.update(_run("streamed+overlap", 0.2, 0.04, 0.19))        # 0.75x; step 20%: not met; plan 1.05
    results.update(_run("nvme", 4.0, 3.0, None,                      # no prediction: no figure
                        bytes_per_step={"host->nvme": 4e9, "nvme->host": 6e9, "device->host": 1e9}))
    return {"args": {"model": "llama", "layers": 16, "hidden": 2048, "batch": 4, "seq": 2048,
                     "precision": "bf16", "device": "cuda"}, "results": results}


def _io_figures(fio=True):
    rows = []
    for op, strata_gbps, fio_gbps in (("write", 3.3, 3.0), ("read", 2.3, 2.0)):
        row = {"op": op, "strata_median_gbps": strata_gbps}
        if fio:
            row["fio_median_gbps"] = fio_gbps
        rows.append(row)
    return {"results": rows}


def _large_figures(mfu):
    return {"args": {"layers": 32, "hidden": 4096, "micro_batches": 8, "batch": 4, "seq": 2048,
                     "device": "cuda", "peak_tflops": 989},
            "result": {"parameters": 6_738_415_616, "s_per_step": 9.0, "tokens_per_s": 7282.0, "mfu": mfu,
                       "predicted_step_s": 10.0}}


def test_the_goals_table_marks_each_goal_met_or_not(tmp_path):
    paths = {}
    for name, figures in (("train", _train_figures()), ("io", _io_figures()), ("large", _large_figures(0.41))):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(figures))
    out = tmp_path / "goals.json"
    run = subprocess.run([sys.executable, GOALS, "--train", str(paths["train"]), "--io", str(paths["io"]),
                          "--large", str(paths["large"]), "--json", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    goals = json.loads(out.read_text())
    rows = {r["run"]: r for r in goals["train"]}
    assert list(rows) == ["fits", "streamed", "streamed+overlap", "nvme"]
    assert dict(rows["fits"]["goals"]) == {"x plain >= 0.9": "met", "plan within 15%": "met"}
    assert rows["fits"]["x_plain"] == pytest.approx(0.15 / 0.16)
    assert rows["fits"]["measured_over_predicted"] == pytest.approx(0.16 / 0.15)
    assert dict(rows["streamed"]["goals"]) == {"plan within 15%": "not met"}
    assert dict(rows["streamed+overlap"]["goals"]) == {"x plain >= 0.7": "met", "step <= 15%": "not met",
                                                       "plan within 15%": "met"}
    assert rows["streamed+overlap"]["step_share"] == pytest.approx(0.2)
    assert dict(rows["nvme"]["goals"]) == {"plan within 15%": "no figure"}
    assert rows["nvme"]["nvme_gbps"] == pytest.approx(10e9 / 4.0 / 1e9)  # NVMe's links only
    assert goals["drive"] == {"read_gbps": 2.0, "write_gbps": 3.0, "source": "fio"}
    assert dict(goals["large"]["goals"]) == {"MFU >= 40%": "met", "plan within 15%": "met"}
    assert "goals met: 6 of 9" in run.stdout
    assert "fio" in run.stdout and "7282" in run.stdout


def test_the_goals_table_takes_strata_figures_without_fio_and_marks_a_low_mfu():
    goals = _module(GOALS, "gpu_goals")
    assert goals.drive_speed(_io_figures(fio=False)) == {"read_gbps": 2.3, "write_gbps": 3.3, "source": "strata"}
    assert dict(goals.large_row(_large_figures(0.27))["goals"])["MFU >= 40%"] == "not met"
    assert dict(goals.large_row(_large_figures(None))["goals"])["MFU >= 40%"] == "no figure"
    assert goals.plan_goal(1.0, 0.86) == (pytest.approx(1 / 0.86), "not met")


def test_the_goals_table_says_so_when_a_run_left_no_figures(tmp_path):
    run = subprocess.run([sys.executable, GOALS, "--train", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "left no figures" in run.stdout and "goals met: 0 of 0" in run.stdout
