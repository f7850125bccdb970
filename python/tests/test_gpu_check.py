"""scripts/gpu_goals.py (the GPU goals table) on fabricated benchmark figures, and benchmarks/large_bench.py
in a tiny shape on the emulated device: its weights written as shards, streamed in with weights=, steps run."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
GOALS = os.path.join(ROOT, "scripts", "gpu_goals.py")
LARGE = os.path.join(ROOT, "benchmarks", "large_bench.py")


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
            "result": {"parameters": 6_738_415_616, "s_per_step": 9.0, "step_phase_s": 1.8, "tokens_per_s": 7282.0,
                       "mfu": mfu,
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
    assert goals["large"]["step_share"] == pytest.approx(0.2)
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


def test_the_budgets_of_a_7b_llama_on_a_128_gib_host():
    large = _module(LARGE, "large_bench")
    gib = 2**30
    plan = large.plan_budgets(6_738_415_616, 124 * gib, 20 * gib, 8 * gib)
    assert plan["homes_bytes"] == 16 * 6_738_415_616                     # 100.4 GiB: more than the room
    assert plan["host_budget_bytes"] == 96 * gib
    assert plan["states_on_nvme_bytes"] == plan["homes_bytes"] - 96 * gib  # about 4.4 GiB of states
    small = large.plan_budgets(1_000_000, 124 * gib, 20 * gib, 8 * gib)
    assert small["host_budget_bytes"] == int(16 * 1_000_000 * 1.125) and small["states_on_nvme_bytes"] == 0
    with pytest.raises(ValueError, match="no room"):
        large.plan_budgets(6_738_415_616, 32 * gib, 20 * gib, 8 * gib)


def test_the_large_benchmark_trains_from_sharded_weights_in_a_tiny_shape(tmp_path):
    out = tmp_path / "large.json"
    args = [sys.executable, LARGE, "--dir", str(tmp_path / "run"), "--device", "emulated", "--layers", "2",
            "--hidden", "128", "--heads", "4", "--intermediate", "352", "--vocab", "512", "--seq", "32",
            "--batch", "2", "--micro-batches", "2", "--steps", "3", "--shard-size", "512KiB",
            "--host-memory", "2GiB", "--host-reserve", "512MiB", "--overlap", "16MiB", "--device-budget", "32MiB",
            "--peak-tflops", "1", "--json", str(out)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())["result"]
    weights = tmp_path / "run" / "weights"
    index = json.loads((weights / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((weights / s).is_file() for s in shards)
    assert result["weights_bytes_written"] == 2 * result["parameters"] == index["metadata"]["total_size"]
    assert result["s_per_step"] > 0 and result["tokens_per_s"] == pytest.approx(2 * 2 * 32 / result["s_per_step"])
    assert result["mfu"] is not None and result["budgets"]["states_on_nvme_bytes"] == 0
    assert 0 < result["step_phase_s"] < result["s_per_step"]
    assert "tokens/s" in run.stdout
    # A second run reuses the shards the index lists.
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(out.read_text())["result"]["weights_bytes_written"] == 0 and "reused" in run.stdout
