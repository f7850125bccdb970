"""The main job (examples/finetune.py) in its short mode, as scripts/demo.sh runs it."""

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_demo_short_run_writes_its_report(tmp_path):
    out = tmp_path / "demo"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "finetune.py"), "--short", "--no-progress",
                          "--out", str(out), "--save-every", "2", "--async-save"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "report.json").read_text())
    steps = len(report["loss"])
    assert steps == 6 and len(report["step_time_s"]) == steps
    # Checkpoints written while training went on (the losses below are still PyTorch's): the last two kept.
    assert len(report["checkpoint_seconds_in_loop"]) == 3
    assert (out / "ckpt" / "latest").read_text().strip() == "step-00000006"
    assert sorted(p.name for p in (out / "ckpt").glob("step-*")) == ["step-00000004", "step-00000006"]
    assert report["baseline_step_time_s"] > 0
    # Plain PyTorch from the same weights on the same batches: the same losses.
    for ours, theirs in zip(report["loss"], report["baseline_loss"]):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    assert set(report["tier_budget_bytes"]) == {"device", "host", "nvme"}
    for tier in ("device", "host"):
        assert 0 < report["tier_peak_bytes"][tier] <= report["tier_budget_bytes"][tier]
    # All three tiers hold model states: the device below the parameters, the host below the optimizer states.
    assert report["tier_peak_bytes"]["nvme"] > 0
    assert report["tier_budget_bytes"]["device"] < report["model_state_bytes"] / 4
    assert report["bytes_moved"]["nvme->host"] > 0
    for image in ("memory.png", "loss.png"):
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "strata / PyTorch" in run.stdout


def test_demo_in_the_layered_order_trains_as_plain_pytorch(tmp_path):
    out = tmp_path / "demo"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "finetune.py"), "--short", "--no-progress",
                          "--out", str(out), "--accumulation", "layered"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "report.json").read_text())
    # Each sequence a micro-batch: 4 a step, each of 2 layers' inputs held (32 x 64 fp32).
    assert report["accumulation"]["order"] == "layered" and report["accumulation"]["micro_batches"] == 4
    assert report["accumulation"]["boundary_bytes"] == 4 * 2 * 32 * 64 * 4
    for ours, theirs in zip(report["loss"], report["baseline_loss"]):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    assert "4 micro-batches a step, layered order" in run.stdout


def test_demo_with_int8_states_trains_on_three_tiers(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import finetune
    from gpt import GPT
    out = tmp_path / "demo"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "finetune.py"), "--short", "--no-progress",
                          "--out", str(out), "--states", "int8"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "report.json").read_text())
    model = GPT(vocab=256, hidden=64, layers=2, heads=2, seq=32)  # the --short shape
    int8, fp32 = (finetune.model_state_bytes(model, "fp32", states)[0] for states in ("int8", "fp32"))
    assert report["model_state_bytes"] == int8 < 0.7 * fp32
    assert report["tier_peak_bytes"]["nvme"] > 0 and report["loss"][-1] < report["loss"][0]


def test_demo_starts_from_a_saved_state_dict(tmp_path):
    import torch
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT
    torch.manual_seed(123)
    state = GPT(vocab=256, hidden=64, layers=2, heads=2, seq=32).state_dict()  # the --short shape
    for value in state.values():
        value.mul_(0.5)
    torch.save(state, tmp_path / "init.pt")
    losses = []
    for extra in ([], ["--init", str(tmp_path / "init.pt")]):
        out = tmp_path / ("init" if extra else "fresh")
        run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "finetune.py"), "--short",
                              "--no-progress", "--out", str(out)] + extra, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        report = json.loads((out / "report.json").read_text())
        losses.append(report["loss"])
        # The plain PyTorch run starts from the same weights.
        assert abs(report["loss"][0] - report["baseline_loss"][0]) <= 1e-5 * report["baseline_loss"][0]
    assert losses[0][0] != losses[1][0]


def test_the_example_model_makes_its_tensors_on_its_inputs_device():
    # On "meta" as on "cuda": a tensor made on the CPU inside forward (the causal mask) is refused there.
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT

    with torch.device("meta"):
        model = GPT(vocab=32, hidden=16, layers=2, heads=2, seq=8)
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    assert model(tokens, tokens).device.type == "meta"
