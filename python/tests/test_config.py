import json

import pytest

import strata


def test_defaults_are_the_engines():
    config = strata.load_config()
    assert config.gradient_accumulation_steps == 1
    assert config.describe()["optimizer.kind"] == "adamw"
    assert "device.budget" in strata.option_keys()


def test_the_adapters_keys_map_onto_the_engines():
    config = strata.load_config({
        "optimizer": {"type": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.01},
        "precision": "bf16",
        "device": {"budget": "64MiB"},
        "host.budget": 256 << 20,
        "nvme": {"dirs": ["/tmp/a", "/tmp/b"], "capacity": "1GiB"},
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
    })
    values = config.describe()
    assert values["optimizer.kind"] == "sgd"
    assert float(values["optimizer.lr"]) == 0.5
    assert float(values["optimizer.momentum"]) == 0.9
    assert values["precision"] == "bf16"
    assert values["device.budget"] == "64MiB"
    assert values["host.budget"] == "256MiB"
    assert values["nvme.dirs"] == "/tmp/a,/tmp/b"
    assert float(values["optimizer.max_grad_norm"]) == 1.0
    assert config.gradient_accumulation_steps == 4


def test_betas_set_both_moments():
    values = strata.load_config({"optimizer": {"betas": [0.8, 0.95]}}).describe()
    assert float(values["optimizer.beta1"]) == 0.8
    assert float(values["optimizer.beta2"]) == 0.95
    with pytest.raises(ValueError, match="optimizer.betas"):
        strata.load_config({"optimizer": {"betas": [0.9]}})


@pytest.mark.parametrize("config, named", [
    ({"device": {"budgett": "1GiB"}}, "device.budgett"),
    ({"device": {"budget": "lots"}}, "device.budget"),
    ({"precision": "fp8"}, "precision"),
    ({"optimizer": {"type": "lion"}}, "optimizer.kind"),
    ({"optimizer": {"beta1": 1.5}}, "optimizer.beta1"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps"),
    ({"gradient_clipping": -1}, "optimizer.max_grad_norm"),
])
def test_bad_keys_and_values_name_the_key(config, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        strata.load_config(config)


def test_a_json_file_reads_like_the_dict(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"optimizer": {"type": "adam", "lr": 0.01}, "host": {"budget": "1GiB"}}))
    values = strata.load_config(path).describe()
    assert values["optimizer.kind"] == "adam"
    assert values["host.budget"] == "1GiB"
    with pytest.raises(ValueError, match="cannot read"):
        strata.load_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        strata.load_config(tmp_path / "bad.json")
