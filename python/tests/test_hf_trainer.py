"""StrataTrainer: the Hugging Face Trainer training through strata, against a plain Trainer on a tiny Llama
(fp32, 20 steps, warm-up and cosine decay, the Trainer's two param groups, gradient accumulation 2, clipping
on), with chunks on all three tiers; its checkpoints, resuming, save_model, and what it refuses."""

import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from strata.hf import STRATA_CHECKPOINT, StrataTrainer  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
STEPS = 20
# The model's 94k parameters take 368KiB a kind: the device holds a quarter of the parameters, the host some
# of every kind, NVMe the rest.
BUDGETS = {"device": 96 * 1024, "host": 384 * 1024}


def llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def sequences(count=4 * STEPS, length=16, vocab=128, seed=1):
    """Learnable token ids (a random first token, then t -> (5t + 3) mod vocab), as their own labels."""
    tokens = [torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))]
    for _ in range(length - 1):
        tokens.append((tokens[-1] * 5 + 3) % vocab)
    return [{"input_ids": row, "labels": row} for row in torch.stack(tokens, dim=1)]


def arguments(output_dir, **extra):
    """20 steps of 2 micro-batches of 2, AdamW with weight decay, warm-up and cosine decay, clipping to 0.5
    (below the gradients' norms), logged every step; on the CPU (strata's emulated device)."""
    values = dict(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, learning_rate=1e-2, weight_decay=0.1, warmup_steps=5,
                  lr_scheduler_type="cosine", max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=True, disable_tqdm=True)
    return transformers.TrainingArguments(**{**values, **extra})


def strata_config(nvme, **extra):
    os.makedirs(nvme, exist_ok=True)
    return {"device": {"backend": "emulated", "budget": BUDGETS["device"]}, "host": {"budget": BUDGETS["host"]},
            "nvme": {"dirs": [str(nvme)]}, "chunk": {"size_elems": 4096}, "log": {"level": "error"}, **extra}


def logged(trainer):
    """Each step's logged loss, learning rate and gradient norm, by step."""
    return {h["step"]: (h["loss"], h["learning_rate"], h["grad_norm"]) for h in trainer.state.log_history
            if "loss" in h}


def assert_close(ours, theirs, rtol=1e-5):
    assert ours.keys() == theirs.keys()
    for step in ours:
        for mine, reference in zip(ours[step], theirs[step]):
            assert abs(mine - reference) <= rtol * abs(reference), (step, ours[step], theirs[step])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One CPU thread: both runs reduce in the same order, and a shared test machine runs them fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain Trainer's 20 steps, and StrataTrainer's, which saves a checkpoint every 10."""
    root = tmp_path_factory.mktemp("trainer")
    plain = transformers.Trainer(model=llama(), args=arguments(root / "plain"), train_dataset=sequences())
    plain.train()
    ours = StrataTrainer(model=llama(), args=arguments(root / "strata", save_strategy="steps", save_steps=10),
                         train_dataset=sequences(), strata_config=strata_config(root / "nvme"))
    ours.train()
    return plain, ours, root


def test_losses_learning_rates_and_grad_norms_match_a_plain_trainer(runs):
    plain, ours, _ = runs
    theirs = logged(plain)
    assert sorted(theirs) == list(range(1, STEPS + 1))
    assert_close(logged(ours), theirs)
    assert [lr for _, lr, _ in logged(ours).values()] == [lr for _, lr, _ in theirs.values()]
    assert theirs[1][1] == 0.0 and theirs[6][1] == 1e-2 and theirs[STEPS][1] < 1e-3  # warm-up, then decay
    assert min(norm for _, _, norm in theirs.values()) > 0.5  # every step clipped
    assert theirs[STEPS][0] < theirs[1][0] * 0.7
    assert ours.strata_engine.stats()["steps"] == STEPS


def test_the_optimizer_has_the_trainers_groups_and_the_chunks_all_three_tiers(runs):
    plain, ours, _ = runs
    names = lambda trainer: {id(p): n for n, p in trainer.model.named_parameters()}  # noqa: E731
    groups = lambda trainer: [({names(trainer)[id(p)] for p in g["params"]}, g["weight_decay"])  # noqa: E731
                              for g in trainer.optimizer.param_groups]
    assert groups(ours) == groups(plain)
    assert [wd for _, wd in groups(ours)] == [0.1, 0.0]
    engine = ours.strata_engine
    assert {tier for kind in engine.chunk_tiers().values() for tier in kind} == {"device", "host", "nvme"}
    tiers = engine.stats()["tiers"]
    for tier, budget in BUDGETS.items():
        assert 0 < tiers[tier]["peak_bytes"] <= budget, (tier, tiers[tier])


def test_a_checkpoint_holds_strata_s_checkpoint_beside_the_trainer_s_own_files(runs):
    _, _, root = runs
    files = set(os.listdir(root / "strata" / "checkpoint-10"))
    assert {STRATA_CHECKPOINT, "scheduler.pt", "trainer_state.json", "rng_state.pth", "model.safetensors"} <= files
    assert "optimizer.pt" not in files  # the optimizer's states are strata's
    assert sorted(os.listdir(root / "strata" / "checkpoint-10" / STRATA_CHECKPOINT)) == ["latest", "step-00000010"]


def test_resuming_from_the_step_10_checkpoint_gives_the_same_steps_11_to_20(runs, tmp_path):
    """resume_from_checkpoint=True takes the latest checkpoint in output_dir: here step 10's alone. The model
    starts from other values: the checkpoint's replace them."""
    plain, ours, root = runs
    shutil.copytree(root / "strata" / "checkpoint-10", tmp_path / "out" / "checkpoint-10")
    resumed = StrataTrainer(model=llama(seed=5), args=arguments(tmp_path / "out"), train_dataset=sequences(),
                            strata_config=strata_config(tmp_path / "nvme"))
    resumed.train(resume_from_checkpoint=True)
    later = {step: values for step, values in logged(resumed).items() if step > 10}
    assert sorted(later) == list(range(11, STEPS + 1))
    assert later == {step: values for step, values in logged(ours).items() if step > 10}
    assert_close(later, {step: values for step, values in logged(plain).items() if step > 10})


def test_save_model_writes_a_directory_from_pretrained_reads(runs, tmp_path):
    _, ours, _ = runs
    ours.save_model(tmp_path / "model")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    values = ours.strata_engine.state_dict()
    assert values.keys() == loaded.keys()
    for name, value in values.items():
        assert torch.equal(value, loaded[name]), name


def both(tmp_path, train_dataset, **extra):
    """A plain Trainer and StrataTrainer trained alike (positional arguments, as the Trainer takes them)."""
    plain = transformers.Trainer(llama(), arguments(tmp_path / "plain", **extra), None, train_dataset)
    ours = StrataTrainer(llama(), arguments(tmp_path / "strata", **extra), None, train_dataset,
                         strata_config=strata_config(tmp_path / "nvme"))
    plain.train()
    ours.train()
    return plain, ours


def test_an_epochs_short_last_step_and_evaluate_match_a_plain_trainer(tmp_path):
    """7 sequences in batches of 2 are 4 micro-batches an epoch: accumulating 3, each epoch's second step has 1."""
    plain, ours = both(tmp_path, sequences(count=7), max_steps=-1, num_train_epochs=2, gradient_accumulation_steps=3)
    assert sorted(logged(plain)) == [1, 2, 3, 4]
    assert_close(logged(ours), logged(plain))
    assert ours.strata_engine.stats()["steps"] == 4
    evaluated = [trainer.evaluate(sequences(count=4, seed=2))["eval_loss"] for trainer in (ours, plain)]
    assert abs(evaluated[0] - evaluated[1]) <= 1e-5 * evaluated[1]


def test_gradient_checkpointing_matches_a_plain_trainer(tmp_path):
    plain, ours = both(tmp_path, sequences(), max_steps=4, gradient_checkpointing=True)
    assert ours.model.is_gradient_checkpointing
    assert_close(logged(ours), logged(plain))


def test_sgd_with_nesterov_momentum_from_optim_args_matches_a_plain_trainer(tmp_path):
    plain, ours = both(tmp_path, sequences(), max_steps=6, optim="sgd", optim_args="momentum=0.9,nesterov=true",
                       learning_rate=0.1)
    assert (ours.optimizer.param_groups[0]["momentum"], ours.optimizer.param_groups[0]["nesterov"]) == (0.9, True)
    assert_close(logged(ours), logged(plain))


def test_an_8bit_adamw_trains_with_int8_states_as_torchaos_does(tmp_path, monkeypatch):
    """optim="adamw_torch_8bit": the plain Trainer's torchao AdamW8bit (run eagerly, with strata's code maps, as
    test_int8_states.py runs it), and strata's int8 states, which follow it within a thousandth."""
    pytest.importorskip("torchao")
    from torchao.optim import subclass_8bit
    from strata import _strata
    for signed, name in ((True, "get_qmap_signed"), (False, "get_qmap_unsigned")):
        monkeypatch.setattr(subclass_8bit, name, lambda signed=signed: tuple(_strata.state_code_map(signed)))
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    plain, ours = both(tmp_path, sequences(), max_steps=6, optim="adamw_torch_8bit")
    assert type(plain.optimizer.optimizer).__name__ == "AdamW8bit"
    assert {c["dtype"] for c in ours.strata_engine.engine.chunks() if c["kind"] == "exp_avg"} == {"int8", "fp32"}
    assert_close(logged(ours), logged(plain), rtol=1e-3)


@pytest.mark.parametrize("optim", ["adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit"])
def test_every_8bit_adamw_name_is_int8_states(optim, tmp_path):
    trainer = StrataTrainer(model=llama(), args=arguments(tmp_path / "out", optim=optim), train_dataset=sequences(),
                            strata_config=strata_config(tmp_path / "nvme"))
    assert {c["dtype"] for c in trainer.strata_engine.engine.chunks() if c["kind"] == "exp_avg_sq"} == {"int8", "fp32"}
    assert trainer.strata_engine.optimizer.param_groups[0]["betas"] == (0.9, 0.999)


def test_bf16_true_trains_in_strata_s_bf16(tmp_path):
    trainer = StrataTrainer(model=llama(), args=arguments(tmp_path / "out", bf16=True, max_steps=2),
                            train_dataset=sequences(), strata_config=strata_config(tmp_path / "nvme"))
    assert trainer.strata_engine.precision == "bf16"
    trainer.train()
    assert len(logged(trainer)) == 2 and trainer.strata_engine.stats()["steps"] == 2


def test_an_fp16_step_the_loss_scale_skips_holds_the_schedule_back(tmp_path):
    # A first loss scale of 2^40 overflows fp16's gradients: strata skips each update (halving the scale) and the
    # Trainer must hold the learning-rate schedule back, as it does when its GradScaler skips a step.
    trainer = StrataTrainer(model=llama(), args=arguments(tmp_path / "out", fp16=True, max_steps=4, warmup_steps=0,
                                                          lr_scheduler_type="linear"),
                            train_dataset=sequences(),
                            strata_config=strata_config(tmp_path / "nvme", loss_scale={"init": 2.0**40, "max": 2.0**40}))
    trainer.train()
    assert trainer.strata_engine.precision == "fp16" and trainer.strata_engine.stats()["steps"] == 0
    assert [lr for _, lr, _ in logged(trainer).values()] == [1e-2] * 4
    assert trainer.lr_scheduler.last_epoch == 0


def _deepspeed(args):
    args.deepspeed = {"zero_optimization": {"stage": 3}}  # set after: TrainingArguments needs deepspeed installed


def _fsdp(args):
    args.fsdp = True  # set after: TrainingArguments refuses FSDP outside a distributed launch


REFUSED = {
    "optim": (dict(optim="adafactor"), {}, None, r"optim='adafactor'.*adamw_torch, adamw_torch_fused, sgd"),
    "states of an 8-bit optim": (dict(optim="adamw_torch_8bit"), {"optimizer": {"states": "bf16"}}, None,
                                 r"optimizer.states 'bf16' disagrees with TrainingArguments\(optim='adamw_torch_8bit'\)"),
    "deepspeed": ({}, {}, _deepspeed, r"deepspeed=.*is set"),
    "fsdp": ({}, {}, _fsdp, r"fsdp=True.*is set"),
    "precision": (dict(bf16=True), {"precision": "fp32"}, None, r"precision 'fp32' disagrees with .*bf16.*'bf16'"),
    "device": ({}, {"device": {"backend": "cuda"}}, None, r"device.backend 'cuda' disagrees.*use_cpu=True"),
    "lr in strata_config": ({}, {"optimizer": {"lr": 1e-3}}, None, r"optimizer.lr, which .* \(learning_rate\)"),
    "accumulation in strata_config": ({}, {"gradient_accumulation_steps": 4}, None,
                                      r"sets gradient_accumulation_steps, which the TrainingArguments decide"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_configuration_strata_cannot_honour_is_refused_before_it_takes_the_model(case, tmp_path):
    extra, config, change, message = REFUSED[case]
    args = arguments(tmp_path / "out", **extra)
    if change is not None:
        change(args)
    model = llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        StrataTrainer(model=model, args=args, train_dataset=sequences(),
                      strata_config=strata_config(tmp_path / "nvme", **config))
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and torch.equal(p, before[name]), name


def test_an_optimizer_or_model_init_of_the_users_own_is_refused(tmp_path):
    model = llama()
    config = strata_config(tmp_path / "nvme")
    with pytest.raises(ValueError, match=r"optimizers= is set, but the optimizer is strata's"):
        StrataTrainer(model=model, args=arguments(tmp_path), optimizers=(torch.optim.AdamW(model.parameters()), None),
                      strata_config=config)
    with pytest.raises(ValueError, match=r"model_init= builds a fresh model"):
        StrataTrainer(model_init=llama, args=arguments(tmp_path), strata_config=config)


def test_resuming_from_a_checkpoint_without_strata_s_is_refused(runs, tmp_path):
    plain, _, _ = runs
    plain.save_model(tmp_path / "plain")  # the model, but no optimizer states strata could load
    trainer = StrataTrainer(model=llama(), args=arguments(tmp_path / "out"), train_dataset=sequences(),
                            strata_config=strata_config(tmp_path / "nvme"))
    with pytest.raises(ValueError, match=r"holds no strata checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain"))
    assert trainer.strata_engine.stats()["steps"] == 0
