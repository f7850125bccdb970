"""Hugging Face checkpoints in and out: a directory save_pretrained wrote (one safetensors file, or shards)
loads into strata with its weights streamed into the chunks; engine.export_safetensors writes a file that
safetensors and from_pretrained read back to the same values."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

import strata  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
              attn_implementation="eager")
TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def saved_llama(directory, **save):
    """A tiny Llama with random weights, saved by save_pretrained into `directory`."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(directory, safe_serialization=True, **save)
    return model


def empty_llama(tie=True):
    """The same architecture with no parameter storage (buffers real), as from_pretrained builds it."""
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    if tie:
        model.tie_weights()  # init_empty_weights re-registers every parameter: the tie is lost until then
    return model


def engine_of(model, tmp_path, weights):
    config = {"device": {"backend": "emulated", "budget": 96 * 1024}, "host": {"budget": 160 * 1024},
              "nvme": {"dirs": [str(tmp_path / "nvme")]}, "chunk": {"size_elems": 4096}, "log": {"level": "error"}}
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return strata.initialize(model, config, weights=weights)


def logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("layout", ["file", "shards", "bin"])
def test_a_save_pretrained_directory_loads_into_the_chunks(tmp_path, layout):
    """One safetensors file, shards of 20kB under an index, or an older checkpoint's pytorch_model.bin (what
    save_pretrained wrote before safetensors): the engine computes what the saved model does."""
    source = saved_llama(tmp_path / "hf", **({"max_shard_size": "20KB"} if layout == "shards" else {}))
    if layout == "bin":
        (tmp_path / "hf" / "model.safetensors").unlink()
        torch.save(source.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    files = os.listdir(tmp_path / "hf")
    assert ("model.safetensors.index.json" in files) == (layout == "shards"), files
    model = empty_llama()
    engine = engine_of(model, tmp_path, weights=tmp_path / "hf")
    engine.eval()
    assert torch.equal(logits(model), logits(source.eval()))
    values = engine.state_dict()
    for name, value in source.state_dict().items():
        if name in values:
            assert torch.equal(values[name], value), name


def test_an_export_reads_back_through_safetensors_and_from_pretrained(tmp_path):
    saved_llama(tmp_path / "hf")
    model = empty_llama()
    engine = engine_of(model, tmp_path, weights=tmp_path / "hf")
    for _ in range(2):  # trained a little: the values are the engine's own
        loss = engine(input_ids=TOKENS, labels=TOKENS).loss
        engine.backward(loss)
        engine.step()
    out = tmp_path / "export"
    out.mkdir()
    engine.export_safetensors(out / "model.safetensors")
    transformers.LlamaConfig(**CONFIG).save_pretrained(out)
    values = engine.state_dict()
    read = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert set(read) == set(values)
    for name, value in values.items():
        assert torch.equal(read[name], value), name
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    engine.eval()
    assert torch.equal(logits(loaded), logits(model))


def test_a_directory_without_weights_or_an_untied_model_is_refused_with_the_way_out(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds none of model.safetensors"):
        engine_of(empty_llama(), tmp_path, weights=tmp_path / "empty")
    saved_llama(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"lacks lm_head.weight.*call model.tie_weights\(\)"):
        engine_of(empty_llama(tie=False), tmp_path, weights=tmp_path / "hf")
