"""PEFT LoRA through strata: the frozen base weights live in param chunks alone (no gradient, no optimizer
state), the adapters train as plain PEFT training does, and the merged model exports to safetensors."""

import copy

import pytest
import torch

from models import relative_errors, three_tiers, with_lora

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

import strata  # noqa: E402

STEPS = 10
LR = 1e-3


def lora_llama(seed=0):
    """A tiny Llama (grouped-query attention) with LoRA adapters on its attention projections. The adapters'
    B matrices start at random values instead of PEFT's zeros, so that A's gradients are not zero at the start."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="eager")
    return with_lora(transformers.LlamaForCausalLM(config), r=4)


def token_batches(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(steps)]


def plain_peft_training(model, data):
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.01)
    losses = []
    for tokens in data:
        loss = model(input_ids=tokens, labels=tokens).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def config(tmp_path):
    """The model's 92,224 parameters take 400KiB of param chunks of 4096 elements: the device holds 48KiB of
    them, the host 96KiB (a step's host room for the adapters' group and one chunk more), the rest is on NVMe."""
    return three_tiers(tmp_path, optimizer={"lr": LR}, device={"budget": 48 * 1024}, host={"budget": 96 * 1024},
                       chunk={"size_elems": 4096})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The LoRA model trained through strata and through plain PyTorch, from the same start."""
    model = lora_llama()
    reference, start = copy.deepcopy(model), {k: v.clone() for k, v in model.state_dict().items()}
    data = token_batches(STEPS)
    theirs = plain_peft_training(reference, data)
    engine = strata.initialize(model, config(tmp_path_factory.mktemp("nvme")))
    ours = []
    for tokens in data:
        loss = engine(input_ids=tokens, labels=tokens).loss
        ours.append(loss.item())
        engine.backward(loss)
        engine.step()
    return engine, model, reference, start, ours, theirs


def test_lora_trains_like_plain_peft_over_three_tiers(trained):
    engine, _, reference, start, ours, theirs = trained
    assert max(relative_errors(ours, theirs)) <= 1e-5, (ours, theirs)
    tiers = engine.stats()["tiers"]  # where chunks sit at the end varies; each tier's peak says it held some
    assert all(tiers[tier]["peak_bytes"] > 0 for tier in ("device", "host", "nvme")), tiers
    assert tiers["device"]["peak_bytes"] <= 48 * 1024 and tiers["host"]["peak_bytes"] <= 96 * 1024, tiers
    values = engine.state_dict()
    for name, p in reference.named_parameters():
        if p.requires_grad:
            error = ((values[name] - p).norm() / p.norm()).item()
            assert error <= 1e-5, (name, error)
        else:  # frozen: exactly as it started
            assert torch.equal(values[name], start[name]), name


def test_frozen_base_weights_have_no_gradient_or_optimizer_chunks(trained):
    """Only the adapters have grad and optimizer-state chunks; the bytes per parameter against full fine-tuning
    (fp32 AdamW: parameter, gradient and two states, 16 bytes)."""
    engine, _, reference, *_ = trained
    names = {record.tensor_id: record.name for record in engine._table.records}
    trainable = {name for name, p in reference.named_parameters() if p.requires_grad}
    size = {}
    for chunk in engine._table.chunks:
        size[chunk["kind"]] = size.get(chunk["kind"], 0) + chunk["size_bytes"]
        if chunk["kind"] != "param":
            assert {names[t] for t in chunk["tensors"]} <= trainable, chunk
    total = sum(p.numel() for p in reference.parameters())
    lora = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    assert set(size) == {"param", "grad", "exp_avg", "exp_avg_sq"}
    # grad and each state: the adapters' elements in whole chunks of 4096
    assert all(size[kind] == -(-lora // 4096) * 4096 * 4 for kind in ("grad", "exp_avg", "exp_avg_sq")), size
    per_parameter = sum(size.values()) / total
    print(f"LoRA: {per_parameter:.2f} bytes per parameter in chunks ({lora} of {total} parameters train); "
          f"full fine-tuning: 16")
    assert per_parameter < 6


def test_merged_model_exports_to_safetensors_and_loads_back(trained, tmp_path):
    """The trained adapters merged into the base weights (on a plain copy of the model, filled from the held
    model's state_dict), saved with save_pretrained(safe_serialization=True): from_pretrained and safetensors
    read back the values, and the merged model computes what the strata-held one does."""
    engine, model, *_ = trained
    plain = lora_llama(seed=1)  # other values, all overwritten below
    plain.load_state_dict(model.state_dict())  # the held model's own state_dict: the values in the chunks
    merged = plain.merge_and_unload()
    merged.save_pretrained(tmp_path, safe_serialization=True)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    for name, value in merged.state_dict().items():
        if name in tensors:
            assert torch.equal(tensors[name], value), name
    tokens = token_batches(1, seed=7)[0]
    engine.eval()
    with torch.no_grad():
        ours = model(input_ids=tokens).logits
        theirs = loaded(input_ids=tokens).logits
    engine.train()
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-5
