"""The Python benchmarks (train_bench.py, adapter_cost.py, accumulation_bench.py, states_quality.py) in short runs on the
emulated device: their figures are there."""

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
BENCH = os.path.join(BENCHMARKS, "train_bench.py")


def test_the_training_benchmark_reports_every_run(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, BENCH, "--layers", "2", "--hidden", "64", "--seq", "32",
                          "--batch", "4", "--steps", "3", "--nvme-dir", str(tmp_path), "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["plain", "fits", "streamed", "streamed+overlap", "nvme", "nvme+overlap"]
    for name, r in results.items():
        assert r["s_per_step"] > 0 and r["tokens_per_s"] > 0, (name, r)
        phases = r["forward_s"] + r["backward_s"] + r["step_phase_s"]
        assert 0.5 * r["s_per_step"] <= phases <= 2 * r["s_per_step"], (name, r)  # medians of each
    for name in ("fits", "streamed", "nvme"):
        assert results[name]["host_syncs_per_step"] > 0, results[name]
        assert results[name]["overlap_groups"] == 0, results[name]
    for name in ("streamed+overlap", "nvme+overlap"):
        assert results[name]["overlap_groups"] > 0, results[name]
    # What each run is named for: everything on the device moves nothing a step; a device below the parameters
    # streams them; states on NVMe are read from there.
    assert not any(results["fits"]["bytes_per_step"].values()), results["fits"]
    assert results["streamed"]["bytes_per_step"]["host->device"] > 0, results["streamed"]
    assert results["nvme"]["bytes_per_step"]["nvme->host"] > 0, results["nvme"]
    assert results["fits"]["budgets"]["device"] > results["streamed"]["budgets"]["device"]
    assert "x plain" in run.stdout and "nvme" in run.stdout
    # Where the step phase went: last_step's phases account for the step (and no more), the kernel ran over every
    # parameter a step, and the step's parts are priced at `strata bench optim`'s rate from the same run.
    for name in ("fits", "streamed", "streamed+overlap", "nvme", "nvme+overlap"):
        a = results[name]["accounting"]
        assert sum(a["phases_s"].values()) <= a["accounted_s"] + 1e-6 <= a["step_phase_s"] + 2e-6, (name, a)
        assert a["bench_params_per_s"] > 0 and a["parts_s"] > 0 and a["step_over_parts"] > 0, (name, a)
    for name in ("fits", "streamed", "nvme"):
        a = results[name]["accounting"]
        assert a["phases_s"]["kernel"] > 0 and a["kernel_over_bench"] > 0 and a["phases_s"]["stats"] > 0, (name, a)
    assert results["nvme"]["accounting"]["phases_s"]["access"] > 0  # its states come from NVMe
    assert "largest phases" in run.stdout


def test_the_adapter_cost_benchmark_reports_microseconds_a_module(tmp_path):
    out = tmp_path / "cost.json"
    run = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "adapter_cost.py"), "--modules", "20", "--steps",
                          "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["modules"] == 20 and result["strata_s_per_step"] > 0 and result["plain_s_per_step"] > 0
    assert result["host_syncs_per_step"] > 0 and "us a module" in run.stdout


def test_the_accumulation_benchmark_compares_both_orders(tmp_path):
    out = tmp_path / "accumulation.json"
    run = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "accumulation_bench.py"), "--layers", "4",
                          "--hidden", "64", "--seq", "32", "--micro-batches", "1,4", "--steps", "3", "--json",
                          str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["standard/1", "layered/1", "standard/4", "layered/4"]
    for name, r in results.items():
        assert r["s_per_step"] > 0 and r["device_budget"] < r["parameter_bytes"], (name, r)
    assert results["layered/4"]["boundary_bytes"] == 4 * 4 * 32 * 64 * 4  # micro-batches x blocks x input
    assert results["standard/4"]["moved_bytes"]["host->device"] > 2 * results["layered/4"]["moved_bytes"]["host->device"]
    assert "x standard" in run.stdout


def test_the_training_benchmark_shortens_backward_to_the_ratio_asked(tmp_path):
    # A model this small updates in well under a millisecond, far below any backward: the fit shortens the
    # sequences from the length given, and every run trains at the length it chose.
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, BENCH, "--layers", "2", "--hidden", "64", "--seq", "64", "--batch", "2",
                          "--steps", "3", "--configs", "streamed", "--backward-to-update", "0.5", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    written = json.loads(out.read_text())
    assert written["args"]["seq"] < 64, written["args"]
    plain = written["results"]["plain"]
    assert plain["backward_over_update"] > 0, plain
    assert f"2 x {written['args']['seq']} tokens" in run.stdout and "x the update" in run.stdout


def test_the_training_benchmark_refuses_to_scale_a_real_devices_compute():
    for flags, says in ((["--device", "cuda", "--backward-to-update", "0.5"], "emulated device's compute"),
                        (["--backward-to-update", "0"], "give a ratio > 0")):
        run = subprocess.run([sys.executable, BENCH, *flags], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and says in run.stderr, run.stderr


def test_the_states_quality_benchmark_compares_a_format_with_fp32_from_the_same_seeds(tmp_path):
    out = tmp_path / "quality.json"
    run = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "states_quality.py"), "--model", "llama", "--steps",
                          "20", "--seeds", "0,1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert sorted(result["losses"]) == ["bf16/seed0", "bf16/seed1", "fp32/seed0", "fp32/seed1"]
    assert all(len(losses) == 20 for losses in result["losses"].values())
    assert result["losses"]["bf16/seed0"] != result["losses"]["fp32/seed0"]  # the format changed the run
    assert result["losses"]["fp32/seed0"][0] == result["losses"]["bf16/seed0"][0]  # from the same model and batch
    assert set(result["gap"]) == {"0", "1"} and "across seeds" in run.stdout
