"""engine.train_step: layered gradient accumulation against the standard order (issue 25).

The two orders compute the same things in another order: with every parameter read once per micro-batch
they give the same losses and parameters bit for bit; a tied embedding's gradient is summed in another
order, so there the goal is 1e-6 relative (each parameter tensor's norm, the losses).
"""

import warnings

import pytest
import torch

import strata
from models import TinyGPT, batches, pair, relative_errors, three_tiers


def tiers(tmp_path, name, **extra):
    """models.three_tiers on a directory of its own under tmp_path."""
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    return three_tiers(tmp_path / name, **extra)


def gpt_loss(model, tokens):
    return model(tokens[:, :-1], tokens[:, 1:])


def untied(seed=0, **kwargs):
    """TinyGPT whose output head has a weight of its own (a copy of the embedding's)."""
    model, _ = pair(seed, **kwargs)
    model.head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model


def train(model, config, mode, micro_batches, steps=10, loss_fn=gpt_loss, data=None):
    """`steps` train_steps of `micro_batches` each in `mode`: the losses (steps x micro-batches), the parameters
    and the engine."""
    engine = strata.initialize(model, config)
    data = data if data is not None else batches(steps * micro_batches, batch=2)
    losses = [engine.train_step(data[s * micro_batches:(s + 1) * micro_batches], loss_fn, accumulation=mode)
              for s in range(steps)]
    return torch.stack(losses), engine.state_dict(), engine


def assert_equal(a, b):
    assert torch.equal(a[0], b[0]), (a[0] - b[0]).abs().max()
    for name, value in a[1].items():
        assert torch.equal(value, b[1][name]), name


def assert_close(a, b):
    assert ((a[0] - b[0]).abs() / b[0].abs()).max() <= 1e-6
    for name, value in a[1].items():
        assert (b[1][name] - value).norm() <= 1e-6 * value.norm(), name


@pytest.mark.parametrize("micro_batches", [4, 8])
def test_layered_steps_are_the_standard_ones_bit_for_bit_with_states_on_nvme(tmp_path, micro_batches):
    runs = {mode: train(untied(layers=4), tiers(tmp_path, mode), mode, micro_batches)
            for mode in ("standard", "layered")}
    assert_equal(runs["layered"], runs["standard"])
    stats = runs["layered"][2].stats()
    assert stats["links"]["nvme->host"]["bytes"] > 0 and stats["links"]["host->nvme"]["bytes"] > 0
    last = runs["layered"][2].last_step
    assert (last["accumulation"], last["micro_batches"], last["step"]) == ("layered", micro_batches, 10)
    # Each block's input held for backward, for every micro-batch: 4 blocks x M x (2 x 16 x 32) fp32.
    assert last["boundary_bytes"] == 4 * micro_batches * 2 * 16 * 32 * 4
    assert runs["standard"][2].last_step["boundary_bytes"] == 0


def test_autograd_is_probed_for_the_order_the_layered_step_rests_on():
    """The one private call (a node's _sequence_nr) is checked by behaviour on the PyTorch that runs: this one
    numbers and runs nodes as the layered order needs; a numbering that is not one after another is named."""
    assert strata.layered.autograd_order_problem() is None
    problem = strata.layered._probe_autograd_order(lambda node: 7)
    assert "numbered [7, 7, 7], not one after another" in problem
    counter = iter(range(100))  # one count across threads, where autograd's is per thread
    problem = strata.layered._probe_autograd_order(lambda node: next(counter))
    assert "two fresh threads numbered their first nodes [0, 1, 2] and [3, 4, 5], not alike" in problem
    with torch.no_grad():  # the caller's grad mode does not matter
        assert strata.layered._probe_autograd_order(strata.layered._sequence_number) is None


def test_where_autograd_orders_otherwise_a_layered_step_runs_in_the_standard_order(tmp_path, monkeypatch):
    monkeypatch.setattr(strata.engine, "autograd_order_problem", lambda: "nodes numbered otherwise")
    standard = train(untied(layers=2), tiers(tmp_path, "standard"), "standard", 4, steps=3)
    with pytest.warns(UserWarning, match="nodes numbered otherwise. The step runs in the standard order"):
        fell_back = train(untied(layers=2), tiers(tmp_path, "layered"), "layered", 4, steps=3)
    assert_equal(fell_back, standard)
    assert fell_back[2].last_step["accumulation"] == "standard"


@pytest.mark.parametrize("micro_batches", [4, 8])
def test_a_tied_embedding_trains_within_rounding_of_the_standard_order(tmp_path, micro_batches):
    runs = {mode: train(pair(layers=4)[0], tiers(tmp_path, mode), mode, micro_batches)
            for mode in ("standard", "layered")}
    assert_close(runs["layered"], runs["standard"])


def test_frozen_parameters_and_overlapped_updates(tmp_path):
    """Frozen blocks and embedding; the optimizer's updates begin beside the layered backward (issue 24)."""
    def model():
        m = untied(layers=4)
        for name, p in m.named_parameters():
            if name.startswith(("blocks.0.", "wpe")):
                p.requires_grad_(False)
        return m
    standard = train(model(), tiers(tmp_path, "s"), "standard", 4)
    layered = train(model(), tiers(tmp_path, "l", optimizer={"overlap": "1MiB"}), "layered", 4)
    assert_equal(layered, standard)
    assert layered[2].last_step["overlap_groups"] > 0
    assert torch.equal(layered[1]["blocks.0.up.weight"], untied(layers=4).state_dict()["blocks.0.up.weight"])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_hugging_face_llama_from_its_config(tmp_path, attention):
    """Its layers get a key/value cache (use_cache is on in its config): left out of the recomputation, which
    would add to it again (eager attention then fails on the mask's shape; sdpa's causal mask hid it)."""
    transformers = pytest.importorskip("transformers")

    def llama():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attn_implementation=attention))

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (40, 2, 16), generator=generator)]
    runs = {}
    for mode in ("standard", "layered"):
        runs[mode] = train(llama(), tiers(tmp_path, mode), mode, 4, loss_fn=lambda m, b: m(**b).loss,
                           data=data)
    assert_equal(runs["layered"], runs["standard"])
    assert runs["layered"][2].accumulation_blocks == "model.layers"


class SkippingGPT(torch.nn.Module):
    """TinyGPT's parts, run in a data-dependent order: a micro-batch whose first token is even skips block 1
    (layer drop); `reverse` runs the blocks last to first."""

    def __init__(self, reverse=False):
        super().__init__()
        self.inner = untied(layers=4)
        self.wpe = self.inner.wpe  # read here, by this module: its hooks materialize it
        del self.inner.wpe
        self.reverse = reverse

    def forward(self, tokens, targets):
        x = self.inner.wte(tokens) + self.wpe[: tokens.shape[1]]
        blocks = list(self.inner.blocks)
        for i, block in enumerate(blocks[::-1] if self.reverse else blocks):
            if not (i == 1 and int(tokens[0, 0]) % 2 == 0):
                x = block(x)
        logits = self.inner.head(self.inner.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("reverse", [False, True])
def test_blocks_skipped_train_exactly_and_out_of_order_within_rounding(tmp_path, reverse):
    data = batches(40, batch=2, seed=5)
    assert len({int(t[0, 0]) % 2 for t in data[:4]}) == 2  # some micro-batches of a step skip, some do not
    standard = train(SkippingGPT(reverse), tiers(tmp_path, "s"), "standard", 4, data=data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layered = train(SkippingGPT(reverse), tiers(tmp_path, "l"), "layered", 4, data=data)
    # Out of order, the gradients sum in another order.
    (assert_close if reverse else assert_equal)(layered, standard)
    out_of_order = [w for w in caught if "entered one twice" in str(w.message)]
    assert len(out_of_order) == (10 if reverse else 0)


def traffic(tmp_path, mode, micro_batches):
    """Bytes a step moves between tiers (engine.stats()'s last_step), all links and host->device, once the plan
    is made (the third step)."""
    config = tiers(tmp_path, "t", device={"budget": 128 * 1024}, host={"budget": "4MiB"})
    engine = strata.initialize(pair(layers=6)[0], config)
    data = batches(3 * micro_batches, batch=2)
    for s in range(3):
        engine.train_step(data[s * micro_batches:(s + 1) * micro_batches], gpt_loss, accumulation=mode)
    moved = engine.stats()["last_step"]["moved_bytes"]
    return sum(moved.values()), moved["host->device"]


def test_layered_chunks_move_once_a_step_whatever_the_micro_batches(tmp_path):
    one = traffic(tmp_path / "1", "layered", 1)
    eight = traffic(tmp_path / "8", "layered", 8)
    standard = traffic(tmp_path / "s", "standard", 8)
    assert pair(layers=6)[0].head.weight.numel() * 4 * 6 < 6 * 128 * 1024  # the parameters exceed the device
    assert 0 < eight[0] <= 1.15 * one[0], (one, eight)
    assert standard[1] >= 4 * one[1], (one, standard)


def test_a_failed_micro_batch_leaves_the_engine_as_it_was(tmp_path):
    data = batches(8, batch=2)
    reference = train(untied(), tiers(tmp_path, "r"), "layered", 4, steps=2, data=data)
    engine = strata.initialize(untied(), tiers(tmp_path, "f"))

    def failing(model, tokens):
        if tokens is data[2]:
            raise KeyError("no such column")
        return gpt_loss(model, tokens)
    with pytest.raises(KeyError, match="no such column"):
        engine.train_step(data[:4], failing, accumulation="layered")
    with pytest.raises(ValueError, match="micro-batch 1 returned a tensor of 2 elements"):
        engine.train_step(data[:4], lambda m, t: torch.stack([gpt_loss(m, t)] * 2) if t is data[1] else
                          gpt_loss(m, t), accumulation="layered")
    losses = [engine.train_step(data[s * 4:(s + 1) * 4], gpt_loss, accumulation="layered") for s in range(2)]
    assert torch.equal(torch.stack(losses), reference[0])
    for name, value in engine.state_dict().items():
        assert torch.equal(value, reference[1][name]), name


def test_what_is_refused(tmp_path):
    class NoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.b(self.a(x)).sum()

    engine = strata.initialize(NoBlocks(), tiers(tmp_path, "n"))
    with pytest.raises(ValueError, match="NoBlocks has no repeated blocks .*accumulation_blocks"):
        engine.train_step([torch.ones(2, 4)], lambda m, x: m(x), accumulation="layered")
    assert engine.train_step([torch.ones(2, 4)], lambda m, x: m(x)).shape == (1,)  # standard, the default
    with pytest.raises(ValueError, match="accumulation 'interleaved' must be one of 'standard', 'layered'"):
        engine.train_step([torch.ones(2, 4)], lambda m, x: m(x), accumulation="interleaved")
    with pytest.raises(ValueError, match="micro_batches is empty"):
        engine.train_step([], lambda m, x: m(x))
    engine = strata.initialize(TinyGPT(), tiers(tmp_path, "b", accumulation="layered", accumulation_blocks="ln_f"))
    with pytest.raises(ValueError, match="accumulation_blocks 'ln_f' must name a non-empty torch.nn.ModuleList .* "
                                         "names a LayerNorm"):
        engine.train_step(batches(1), gpt_loss)
    for key, value, message in [("accumulation", "fast", "must be one of"),
                                ("accumulation_blocks", 3, "must be the name"),
                                ("accumulation_checkpoint", "yes", "must be true or false"),
                                ("accumulation_offload", -1, "must be 0 .held where the model computes. or a size")]:
        with pytest.raises(ValueError, match=f"config: {key} .*{message}"):
            strata.initialize(TinyGPT(), tiers(tmp_path, "c", **{key: value}))


def test_the_configs_order_and_blocks_named(tmp_path):
    """accumulation from the config; the blocks named; checkpointing off holds no boundary inputs of its own."""
    config = tiers(tmp_path, "l", accumulation="layered", accumulation_blocks="blocks", accumulation_checkpoint=False)
    model, reference = pair(layers=4)
    engine = strata.initialize(model, config)
    losses = engine.train_step(batches(4, batch=2), gpt_loss)
    assert engine.last_step["accumulation"] == "layered" and engine.last_step["boundary_bytes"] == 0
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    theirs = []
    for tokens in batches(4, batch=2):
        loss = gpt_loss(reference, tokens)
        (loss / 4).backward()
        theirs.append(loss.item())
    opt.step()
    assert max(relative_errors(losses.tolist(), theirs)) <= 1e-6
    with torch.no_grad():
        assert torch.allclose(engine.state_dict()["blocks.3.up.weight"], reference.blocks[3].up.weight, atol=1e-6)


def test_held_inputs_on_the_host_within_their_budget(tmp_path):
    """accumulation_offload: the blocks' inputs copied to host memory, the same step bit for bit; a budget below
    the step's inputs is refused as the step begins, with the figures, and nothing changes."""
    need = 4 * 4 * 2 * 16 * 32 * 4  # micro-batches x blocks x one input (2 x 16 x 32 fp32)
    standard = train(untied(layers=4), tiers(tmp_path, "s"), "standard", 4)
    layered = train(untied(layers=4), tiers(tmp_path, "l", accumulation_offload=need), "layered", 4)
    assert_equal(layered, standard)
    assert layered[2].last_step["boundary_host_bytes"] == layered[2].last_step["boundary_bytes"] == need

    engine = strata.initialize(untied(layers=4), tiers(tmp_path, "r", accumulation_offload="48KiB"))
    before = engine.state_dict()
    with pytest.raises(ValueError, match=f"take {need} bytes \\(4 micro-batches x 4 blocks x 4096 bytes\\), more "
                                         f"than accumulation_offload's 49152: raise it to at least {need}"):
        engine.train_step(batches(4, batch=2), gpt_loss, accumulation="layered")
    for name, value in engine.state_dict().items():
        assert torch.equal(value, before[name]), name
    engine.train_step(batches(2, batch=2), gpt_loss, accumulation="layered")  # 32KiB: within it
    assert engine.last_step["boundary_host_bytes"] == need // 2
    assert engine.stats()["steps"] == 1 and not torch.equal(engine.state_dict()["blocks.0.up.weight"],
                                                            before["blocks.0.up.weight"])


def test_a_step_that_fails_is_finished_by_engine_step_and_a_step_inside_a_step_is_refused(tmp_path):
    data = batches(8, batch=2)
    reference = train(untied(), tiers(tmp_path, "r"), "layered", 4, steps=2, data=data)
    engine = strata.initialize(untied(), tiers(tmp_path, "f"))
    engine.optimizer.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        engine.train_step(data[:4], gpt_loss, accumulation="layered")
    with pytest.raises(RuntimeError, match="engine.step\\(\\) finishes that step"):
        engine.train_step(data[:4], gpt_loss, accumulation="layered")
    engine.optimizer.param_groups[0]["lr"] = 1e-2
    assert engine.step()  # the gradients of the 4 micro-batches, and no more
    engine.train_step(data[4:], gpt_loss, accumulation="layered")
    for name, value in engine.state_dict().items():
        assert torch.equal(value, reference[1][name]), name

    def nested(model, tokens):
        engine.train_step([tokens], gpt_loss, accumulation="layered")
    with pytest.raises(RuntimeError, match="called inside a layered step's loss_fn"):
        engine.train_step(data[:2], nested, accumulation="layered")
    engine.train_step(data[:2], gpt_loss, accumulation="layered")  # and the engine goes on


def test_held_inputs_come_back_a_block_ahead_of_their_recomputation(tmp_path):
    """With accumulation_offload, as backward recomputes block b, block b-1's inputs of every micro-batch are
    copied back: every recomputation but the last block's finds its inputs there, and the step is the same."""
    standard = train(untied(layers=4), tiers(tmp_path, "s"), "standard", 4, steps=3)
    layered = train(untied(layers=4), tiers(tmp_path, "l", accumulation_offload="1MiB"), "layered", 4, steps=3)
    assert_equal(layered, standard)
    assert layered[2].last_step["boundary_fetched_ahead"] == 3 * 4  # blocks 0 to 2, 4 micro-batches each


def test_models_that_checkpoint_their_blocks_themselves(tmp_path):
    """A Hugging Face model after gradient_checkpointing_enable() keeps its own checkpointing; GPT's reentrant
    checkpointing runs under ours; GPT's non-reentrant one needs accumulation_checkpoint off, and says so."""
    transformers = pytest.importorskip("transformers")

    def llama(reentrant):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager"))
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (12, 2, 16), generator=generator)]
    hf_loss = lambda m, b: m(**b).loss  # noqa: E731
    plain = train(llama(None), tiers(tmp_path, "p"), "standard", 4, steps=3, loss_fn=hf_loss, data=data)
    for reentrant in (False, True):
        layered = train(llama(reentrant), tiers(tmp_path, f"h{reentrant}"), "layered", 4, steps=3, loss_fn=hf_loss,
                        data=data)
        assert_equal(layered, plain)

    def gpt(checkpoint):
        model = untied(layers=4)
        model.checkpoint = checkpoint
        return model
    standard = train(gpt(False), tiers(tmp_path, "s"), "standard", 4, steps=3)
    assert_equal(train(gpt(True), tiers(tmp_path, "r"), "layered", 4, steps=3), standard)
    assert_equal(train(gpt("non_reentrant"), tiers(tmp_path, "n", accumulation_checkpoint=False), "layered", 4,
                       steps=3), standard)
    with pytest.raises(RuntimeError, match="set the config's accumulation_checkpoint to false"):
        train(gpt("non_reentrant"), tiers(tmp_path, "f"), "layered", 4, steps=1)


def test_a_lora_model_bit_for_bit(tmp_path):
    """PEFT LoRA on a Llama: the blocks found under the PEFT wrapper, the frozen base and the adapters trained."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from models import with_lora

    def model():
        torch.manual_seed(0)
        return with_lora(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)), r=4)

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (12, 2, 16), generator=generator)]
    standard = train(model(), tiers(tmp_path, "s"), "standard", 4, steps=3, loss_fn=lambda m, b: m(**b).loss,
                     data=data)
    layered = train(model(), tiers(tmp_path, "l"), "layered", 4, steps=3, loss_fn=lambda m, b: m(**b).loss,
                    data=data)
    assert_equal(layered, standard)
    assert layered[2].accumulation_blocks == "base_model.model.model.layers"


def test_a_forward_thread_that_cannot_start_stops_the_others_first(tmp_path, monkeypatch):
    """The caller's side failing while the forwards run (a thread not started; so too Ctrl-C): the forwards
    begun unwind before the error is raised, and the next step is as on a fresh engine."""
    import threading
    data = batches(8, batch=2)
    reference = train(untied(), tiers(tmp_path, "r"), "layered", 4, steps=2, data=data)
    engine = strata.initialize(untied(), tiers(tmp_path, "f"))
    start = threading.Thread.start

    def refuse_the_third(thread):
        if thread.name == "strata-layered-2":
            raise RuntimeError("can't start new thread")
        start(thread)
    monkeypatch.setattr(threading.Thread, "start", refuse_the_third)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        engine.train_step(data[:4], gpt_loss, accumulation="layered")
    monkeypatch.undo()
    assert not [t for t in threading.enumerate() if t.name.startswith("strata-layered-")]
    losses = [engine.train_step(data[s * 4:(s + 1) * 4], gpt_loss, accumulation="layered") for s in range(2)]
    assert torch.equal(torch.stack(losses), reference[0])
    for name, value in engine.state_dict().items():
        assert torch.equal(value, reference[1][name]), name


def test_a_forward_that_holds_its_turn_past_the_wait_timeout_fails_the_step_naming_it(tmp_path):
    """A forward that deadlocks inside a block (here: micro-batch 1 waits in block 1 for an event not yet set) is
    given up on after the engine's wait timeout, with an error naming the micro-batch and the block; the other
    forwards unwind in turn, and the engine refuses to train on. The forward given up on, once it wakes, is refused
    by the engine's hooks; close() waits for it to end before it gives the tiers back."""
    import threading
    import time
    model = untied()
    release = threading.Event()

    def deadlock(module, args):
        if threading.current_thread().name == "strata-layered-1":
            release.wait(60)
    model.blocks[1].register_forward_pre_hook(deadlock)
    engine = strata.initialize(model, tiers(tmp_path, "t", device={"copy_timeout_ms": 300},
                                            nvme={"io_timeout_ms": 300}))
    begun = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"micro-batch 1's forward has held its turn in block 1 .* 0\.3 s"):
            engine.train_step(batches(4, batch=2), gpt_loss, accumulation="layered")
        assert time.monotonic() - begun < 10
        running = [t.name for t in threading.enumerate() if t.name.startswith("strata-layered-")]
        assert running == ["strata-layered-1"], running  # the others unwound
        with pytest.raises(RuntimeError, match="training cannot go on: a layered forward was given up on"):
            engine.train_step(batches(4, batch=2), gpt_loss, accumulation="layered")
        with pytest.raises(RuntimeError, match="a layered forward given up on is still running .strata-layered-1"):
            engine.close()  # it may yet call into the engine: nothing is given back
    finally:
        release.set()
    engine.close()  # it woke, was refused at the next block, and ended
    assert not [t for t in threading.enumerate() if t.name.startswith("strata-layered-")]
    with pytest.raises(RuntimeError, match="the engine was closed"):
        engine.stats()


def test_a_timeout_raised_by_the_loss_fn_is_the_loss_fns_not_a_given_up_forward(tmp_path):
    data = batches(4, batch=2)
    engine = strata.initialize(untied(), tiers(tmp_path, "t"))

    def timing_out(model, tokens):
        if tokens is data[2]:
            raise TimeoutError("the data loader timed out")
        return gpt_loss(model, tokens)
    with pytest.raises(TimeoutError, match="the data loader timed out"):
        engine.train_step(data, timing_out, accumulation="layered")
    engine.train_step(data, gpt_loss, accumulation="layered")  # the engine trains on
    engine.close()
