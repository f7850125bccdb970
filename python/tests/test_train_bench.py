"""benchmarks/train_bench.py in a short run on the emulated device: every configuration's figures are there."""

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_bench.py")


def test_the_training_benchmark_reports_every_run(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, BENCH, "--layers", "2", "--hidden", "64", "--seq", "32",
                          "--batch", "4", "--steps", "3", "--nvme-dir", str(tmp_path), "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["plain", "fits", "streamed", "nvme"]
    for name, r in results.items():
        assert r["s_per_step"] > 0 and r["tokens_per_s"] > 0, (name, r)
        phases = r["forward_s"] + r["backward_s"] + r["step_phase_s"]
        assert 0.5 * r["s_per_step"] <= phases <= 2 * r["s_per_step"], (name, r)  # medians of each
    for name in ("fits", "streamed", "nvme"):
        assert results[name]["host_syncs_per_step"] > 0, results[name]
    assert results["nvme"]["bytes_per_step"]["nvme->host"] > 0, results["nvme"]
    assert results["fits"]["budgets"]["device"] > results["streamed"]["budgets"]["device"]
    assert "x plain" in run.stdout and "nvme" in run.stdout
