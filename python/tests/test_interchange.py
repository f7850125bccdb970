"""safetensors export, and initializing a model from a safetensors file or a state dict without materializing it."""

import json
import struct

import pytest
import torch

import strata
from models import TinyGPT, batches, strata_losses, three_tiers


def read_safetensors(path):
    """A safetensors file read by the format's rules alone: {name: tensor}, and its metadata. The tensors'
    ranges must tile the data exactly, as the safetensors library checks."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    out, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        ranges.append((begin, end))
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
    covered = 0
    for begin, end in sorted(ranges):
        assert begin == covered
        covered = end
    assert covered == len(data)
    return out, header.get("__metadata__", {})


def on_meta(build):
    """The module `build()` makes, on the meta device: built there where torch can (2.0's device context),
    else moved there (its values dropped, which is what the engine must not need)."""
    if hasattr(torch, "set_default_device"):
        with torch.device("meta"):
            return build()
    model = build()
    metas = {}  # one meta tensor per tensor: tied parameters stay tied (Module.to("meta") unties them in 1.13)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, value in table.items():
                if value is not None:
                    meta = torch.empty_like(value, device="meta")
                    if isinstance(value, torch.nn.Parameter):
                        meta = torch.nn.Parameter(meta, requires_grad=value.requires_grad)
                    table[name] = metas.setdefault(id(value), meta)
    return model


def trained(tmp_path, name, precision="bf16", steps=3):
    (tmp_path / name).mkdir()
    torch.manual_seed(0)
    engine = strata.initialize(TinyGPT(), three_tiers(tmp_path / name, precision=precision))
    strata_losses(engine, list(batches(steps)))
    return engine


def test_export_writes_the_parameters_in_the_compute_dtype_or_the_fp32_masters(tmp_path):
    engine = trained(tmp_path, "run")
    out = engine.export_safetensors(tmp_path / "model.safetensors")
    tensors, metadata = read_safetensors(tmp_path / "model.safetensors")
    assert metadata["format"] == "pt"
    expected = engine.state_dict()
    assert out["tensors"] == len(expected) == len(tensors)
    assert all(tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], value)
               for name, value in expected.items())
    engine.export_safetensors(tmp_path / "fp32.safetensors", fp32=True)
    tensors, _ = read_safetensors(tmp_path / "fp32.safetensors")
    masters = engine.state_dict(master=True)
    assert all(tensors[name].dtype == torch.float32 and torch.equal(tensors[name], value)
               for name, value in masters.items())


@pytest.mark.parametrize("form", ["safetensors", "state dict", "torch file"])
def test_a_model_on_the_meta_device_starts_from_the_weights(tmp_path, form):
    """The model is never materialized: its parameters come from the weights into the chunks. Masters and
    parameters equal the exported ones, and training goes on from them as it would from the original."""
    first = trained(tmp_path, "first")
    masters = first.state_dict(master=True)
    if form == "safetensors":
        first.export_safetensors(tmp_path / "w.safetensors", fp32=True)
        weights = tmp_path / "w.safetensors"
    elif form == "state dict":
        weights = masters
    else:
        torch.save(masters, tmp_path / "w.pt")
        weights = tmp_path / "w.pt"
    model = on_meta(TinyGPT)
    (tmp_path / "second").mkdir()
    second = strata.initialize(model, three_tiers(tmp_path / "second", precision="bf16"), weights=weights)
    theirs = second.state_dict(master=True)
    assert all(torch.equal(theirs[name], value) for name, value in masters.items())
    assert all(torch.equal(second.state_dict()[name], value) for name, value in first.state_dict().items())
    # The same start as a materialized model given the same values.
    (tmp_path / "third").mkdir()
    torch.manual_seed(7)
    third = strata.initialize(TinyGPT(), three_tiers(tmp_path / "third", precision="bf16"))
    third.load_weights(masters)
    data = list(batches(2, seed=3))
    assert strata_losses(second, data) == strata_losses(third, data)


def test_weights_that_do_not_fit_are_refused_before_anything_is_set(tmp_path):
    engine = trained(tmp_path, "run", precision="fp32", steps=1)
    before = engine.state_dict()
    wrong = dict(before)
    wrong["wpe"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"wpe is \[3, 3\] there, \[16, 32\] here"):
        engine.load_weights(wrong)
    partial = {name: torch.zeros_like(value) for name, value in before.items() if name != "wpe"}
    partial["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="it lacks wpe; it has extra that the model does not"):
        engine.load_weights(partial)
    assert all(torch.equal(engine.state_dict()[name], value) for name, value in before.items())
    loaded = engine.load_weights(partial, strict=False)
    assert (loaded["missing"], loaded["unused"]) == (["wpe"], ["extra"])
    after = engine.state_dict()
    assert torch.equal(after["wpe"], before["wpe"]) and not after["wte.weight"].any()
    model = on_meta(TinyGPT)
    (tmp_path / "meta").mkdir()
    with pytest.raises(ValueError, match="is on the meta device: pass weights="):
        strata.initialize(model, three_tiers(tmp_path / "meta"))


def test_buffers_come_with_a_state_dict(tmp_path):
    """A module with buffers (BatchNorm's running statistics) built on the meta device: the state dict
    brings the buffers too."""
    def net():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))

    torch.manual_seed(0)
    source = net()
    source(torch.randn(16, 8))  # running statistics away from their start
    state = source.state_dict()
    model = on_meta(net)
    engine = strata.initialize(model, three_tiers(tmp_path, precision="fp32"), weights=state)
    assert torch.equal(model[1].running_mean, state["1.running_mean"])
    assert int(model[1].num_batches_tracked) == 1
    assert torch.equal(engine.state_dict()["0.weight"], state["0.weight"])
    model.eval()
    source.eval()
    x = torch.randn(4, 8)
    assert torch.allclose(engine(x), source(x))


def test_a_tied_parameter_comes_under_any_of_its_names(tmp_path):
    """model.state_dict() names a tied parameter twice (GPT's wte.weight and head.weight): either name sets it."""
    torch.manual_seed(3)
    state = TinyGPT().state_dict()
    assert "head.weight" in state and "wte.weight" in state
    engine = strata.initialize(on_meta(TinyGPT), three_tiers(tmp_path, precision="fp32"), weights=state)
    ours = engine.state_dict()
    assert all(torch.equal(value, state[name]) for name, value in ours.items())
    engine.load_weights({name: torch.zeros_like(value) for name, value in state.items()})
    assert not engine.state_dict()["wte.weight"].any()
    engine.load_weights({name: value for name, value in state.items() if name != "wte.weight"})
    assert torch.equal(engine.state_dict()["wte.weight"], state["head.weight"])


def write_safetensors(path, tensors):
    """A safetensors file written by the format's rules: {name: (dtype name, shape, raw bytes)}."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def batchnorm_net():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def test_a_safetensors_file_with_a_bad_buffer_is_refused_before_anything_is_set(tmp_path):
    """Buffers come from a safetensors file too; one that cannot be read (its bytes not its shape's, for
    its dtype) is refused before the parameters are touched."""
    torch.manual_seed(0)
    source = batchnorm_net()
    source(torch.randn(16, 8))
    state = source.state_dict()
    (tmp_path / "run").mkdir()
    engine = strata.initialize(batchnorm_net(), three_tiers(tmp_path / "run", precision="fp32"))
    before = engine.state_dict()
    dtypes = {torch.float32: "F32", torch.int64: "I64"}
    good = {name: (dtypes[value.dtype], tuple(value.shape), value.numpy().tobytes()) for name, value in state.items()}
    write_safetensors(tmp_path / "good.safetensors", good)
    engine.load_weights(tmp_path / "good.safetensors")
    assert engine.module[1].running_var.equal(state["1.running_var"])
    assert int(engine.module[1].num_batches_tracked) == 1
    assert all(torch.equal(engine.state_dict()[name], state[name]) for name in before)

    bad = dict(good)
    bad["1.num_batches_tracked"] = ("I64", (), b"\0\0\0")  # 3 bytes for an 8-byte scalar
    write_safetensors(tmp_path / "bad.safetensors", bad)
    engine.load_weights({name: torch.zeros_like(value) for name, value in before.items()}, strict=False)
    with pytest.raises(ValueError, match="1.num_batches_tracked"):
        engine.load_weights(tmp_path / "bad.safetensors")
    assert all(not value.any() for value in engine.state_dict().values())  # the parameters untouched


def test_a_shared_modules_buffers_come_under_each_of_its_names(tmp_path):
    """A module used twice (net.a is net.b): its buffers are listed under both names by state_dict()."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.BatchNorm1d(4)
            self.b = self.a
            self.out = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.b(self.a(x)))

    torch.manual_seed(0)
    source = Net()
    source(torch.randn(8, 4))
    state = source.state_dict()
    assert "b.running_mean" in state
    engine = strata.initialize(Net(), three_tiers(tmp_path, precision="fp32"))
    loaded = engine.load_weights(state)
    assert loaded["unused"] == []
    assert engine.module.a.running_mean.equal(state["a.running_mean"])
