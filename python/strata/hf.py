"""The Hugging Face Trainer, training through strata: change ``Trainer`` to ``StrataTrainer``.

    from strata.hf import StrataTrainer
    trainer = StrataTrainer(model=model, args=training_args, train_dataset=data,
                            strata_config={"device": {"budget": "20GiB"}, "host": {"budget": "64GiB"},
                                           "nvme": {"dirs": ["/mnt/nvme"]}})
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)
    trainer.save_model("out")            # a directory from_pretrained reads

StrataTrainer is a ``transformers.Trainer`` (this module needs transformers; ``import strata`` does not) whose
model strata holds from construction on (``trainer.strata_engine``, strata.initialize's engine) and whose
optimizer is the engine's. The TrainingArguments decide, as they do for the Trainer:

- the optimizer: ``optim`` adamw_torch or adamw_torch_fused (AdamW); an 8-bit AdamW (adamw_torch_8bit,
  adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit: AdamW with strata's int8 states, torchao's AdamW8bit scheme,
  whichever library the name comes from); or sgd (momentum, dampening and nesterov from ``optim_args``); ``learning_rate``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``; ``weight_decay`` on
  the parameters the Trainer's get_decay_parameter_names names and none on the others (two param groups, as
  the Trainer makes them). ``lr_scheduler_type`` and the warm-up build the Trainer's own scheduler on
  engine.optimizer, whose param groups strata reads at every step;
- ``gradient_accumulation_steps``, and ``max_grad_norm`` (strata's step clips);
- the precision: ``bf16=True`` is strata's bf16, ``fp16=True`` its fp16 (with its own loss scaling), neither
  fp32;
- the device: the Trainer's (``use_cpu=True``: strata's host-emulated device; else the Trainer's GPU).

``strata_config`` (a dict or a JSON file, as strata.initialize takes it) gives the rest: budgets, NVMe
directories, chunk sizes. It may not set what the arguments decide, except precision, device.backend and
device.index where they agree with them.

Logged as the Trainer logs: loss, learning_rate, and grad_norm, which is the global norm of the gradients
before clipping that strata's step computed (what torch's clip_grad_norm_ returns; under fp16, of the
unscaled gradients), the last step's at each logging step.

A checkpoint (``save_steps``) holds what the Trainer saves itself (the model as save_pretrained writes it,
trainer_state.json, scheduler.pt, rng_state.pth) and, in place of optimizer.pt, strata's checkpoint of every
state in its ``strata/`` folder: parameters, fp32 masters, optimizer moments, the step count, the loss scaler.
``train(resume_from_checkpoint=...)`` loads it. With ``save_only_model=True`` a checkpoint holds the model only,
and cannot be resumed from.

Refused at construction, with an error naming the argument, before strata takes the model: another optim, a
DeepSpeed config, FSDP, several processes or GPUs, model_init, optimizers= or optimizer_cls_and_kwargs=,
fp16_full_eval or bf16_full_eval, fp8, and a strata_config that sets what the arguments decide.

How it sits in the Trainer (the seams are its overridable methods, and two attributes of accelerate's):
the Trainer leaves the model where it is (``_move_model_to_device``; accelerate's ``device_placement`` off),
since moving a held parameter reads it; accelerate's mixed precision is off, since strata computes in its
precision and scales fp16 losses itself. The accelerator's ``backward`` is strata's, with the loss taken as
the Trainer gives it: already the micro-batch's share of the step's loss (divided by the number of items in
the step's micro-batches, or by their count), so strata does not divide again, and the step comes after as
many backwards as the Trainer's accumulation has micro-batches (fewer for an epoch's short last step).
``create_optimizer`` gives engine.optimizer, which accelerate wraps as it wraps any, and whose step tells the
wrapper (its ``_is_overflow``) when fp16's loss scaling skipped the update, so that the Trainer holds the
learning-rate schedule back as it does for its own GradScaler; ``_clip_grad_norm`` leaves clipping to strata's
step. strata's checkpoint loads where the Trainer loads the optimizer's state, after the
scheduler is built, so that the param groups' values are the checkpoint's.
"""

import copy
import inspect
import os

import torch

try:
    import transformers
    from transformers.trainer import SCHEDULER_NAME
except ImportError as error:
    raise ImportError("strata.hf needs transformers: pip install 'strata[hf]'") from error

from .config import config_items
from .engine import initialize

# The Trainer's methods StrataTrainer overrides (tested with transformers 5.17): a transformers without one
# would train past the override, silently (clipping by accelerate, the model moved to the device).
_SEAMS = ("_move_model_to_device", "_build_accelerator_args", "create_accelerator_and_postprocess",
          "create_optimizer", "_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate",
          "_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_optimizer_and_scheduler")
_missing = [name for name in _SEAMS if not hasattr(transformers.Trainer, name)]
if _missing:
    raise ImportError(f"strata.hf: transformers {transformers.__version__}'s Trainer has no {', '.join(_missing)}, "
                      "which StrataTrainer overrides: it runs with transformers 5 (tested with 5.17)")

# strata's checkpoint, inside a Trainer's checkpoint folder.
STRATA_CHECKPOINT = "strata"

# TrainingArguments.optim choices strata's optimizer runs, as its optimizer.type.
_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd", "adamw_torch_8bit": "adamw",
               "adamw_8bit": "adamw", "adamw_bnb_8bit": "adamw", "paged_adamw_8bit": "adamw"}
# Of them, those whose states are 8-bit: strata's optimizer.states int8.
_EIGHT_BIT = {"adamw_torch_8bit", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit"}
# TrainingArguments.mixed_precision (bf16=True: bf16, fp16=True: fp16) as strata's precision.
_PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
# strata_config keys the TrainingArguments decide, and the arguments that do.
_DECIDED = {
    "optimizer.type": "optim", "optimizer.kind": "optim", "optimizer.lr": "learning_rate",
    "optimizer.betas": "adam_beta1 and adam_beta2", "optimizer.beta1": "adam_beta1", "optimizer.beta2": "adam_beta2",
    "optimizer.eps": "adam_epsilon", "optimizer.weight_decay": "weight_decay", "optimizer.momentum": "optim_args",
    "optimizer.dampening": "optim_args", "optimizer.nesterov": "optim_args",
    "optimizer.no_decay": "weight_decay (on the parameters get_decay_parameter_names names)",
    "gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "max_grad_norm",
    "optimizer.max_grad_norm": "max_grad_norm",
}
# strata_config keys that must agree with the TrainingArguments, and what in them decides.
_AGREED = {
    "precision": "the TrainingArguments' bf16 and fp16 (bf16=True: bf16, fp16=True: fp16, neither: fp32)",
    "device.backend": "the Trainer's device (use_cpu=True: strata's emulated device on the CPU; else its GPU, cuda)",
    "device.index": "the Trainer's GPU (TrainingArguments.device)",
}


def _check_inputs(given):
    """ValueError for a Trainer argument StrataTrainer cannot honour (`given`: the arguments by name)."""
    if given.get("model_init") is not None:
        raise ValueError("StrataTrainer: model_init= builds a fresh model for each train(), but strata holds one "
                         "model: pass it as model=")
    if given.get("model") is None:
        raise ValueError("StrataTrainer: model= is required: strata holds the model given, from construction on")
    if any(x is not None for x in given.get("optimizers", (None, None))):
        raise ValueError("StrataTrainer: optimizers= is set, but the optimizer is strata's (trainer.optimizer), "
                         "made from the TrainingArguments (optim, learning_rate, weight_decay, adam_*), and the "
                         "Trainer builds the scheduler on it (lr_scheduler_type, warmup_steps): leave optimizers= "
                         "out, or override create_scheduler")
    if given.get("optimizer_cls_and_kwargs") is not None:
        raise ValueError("StrataTrainer: optimizer_cls_and_kwargs= is set, but the optimizer is strata's: choose it "
                         f"with TrainingArguments(optim=...), one of {', '.join(_OPTIMIZERS)}")


def _check_arguments(args):
    """ValueError naming the TrainingArguments field strata cannot honour, and what would work."""
    optim = getattr(args.optim, "value", args.optim)
    if args.deepspeed:
        raise ValueError("StrataTrainer: TrainingArguments(deepspeed=...) is set: DeepSpeed and strata would both "
                         "hold the model's states. Leave deepspeed out; strata_config gives the budgets and NVMe "
                         "directories")
    if args.fsdp:
        raise ValueError(f"StrataTrainer: TrainingArguments(fsdp={args.fsdp!r}) is set: FSDP and strata would both "
                         "hold the model's states. Leave fsdp out")
    if optim not in _OPTIMIZERS:
        raise ValueError(f"StrataTrainer: TrainingArguments(optim={optim!r}) is not an optimizer strata runs: use "
                         f"one of {', '.join(_OPTIMIZERS)}")
    if args.mixed_precision not in _PRECISIONS:
        raise ValueError(f"StrataTrainer: mixed precision {args.mixed_precision!r} (TrainingArguments or "
                         "ACCELERATE_MIXED_PRECISION) is not one strata computes in: use bf16=True, fp16=True or "
                         "neither (fp32)")
    if args.fp16_full_eval or args.bf16_full_eval:
        raise ValueError("StrataTrainer: TrainingArguments(fp16_full_eval/bf16_full_eval=True) casts the model, "
                         "whose parameters strata holds: leave them out; bf16=True or fp16=True makes strata "
                         "compute in that precision, evaluation included")
    if args.world_size > 1:
        raise ValueError(f"StrataTrainer: {args.world_size} processes (TrainingArguments.world_size): StrataTrainer "
                         "trains in one process; for data parallel, run strata.initialize's engine under torchrun "
                         "or mpirun")
    if args.n_gpu > 1:
        raise ValueError(f"StrataTrainer: {args.n_gpu} GPUs visible, which the Trainer would split batches over "
                         "(nn.DataParallel): make one visible (CUDA_VISIBLE_DEVICES=0)")


def _optimizer_keys(args):
    """strata's optimizer.* from the TrainingArguments, through the Trainer's own reading of them (an 8-bit
    AdamW's as adamw_torch's, which needs neither torchao nor bitsandbytes)."""
    optim = getattr(args.optim, "value", args.optim)
    kind = _OPTIMIZERS[optim]
    read = args
    if optim in _EIGHT_BIT:
        read = copy.copy(args)
        read.optim = transformers.training_args.OptimizerNames.ADAMW_TORCH
    _, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(read)
    keys = {"optimizer.type": kind, "optimizer.lr": kwargs["lr"], "optimizer.weight_decay": args.weight_decay}
    if optim in _EIGHT_BIT:
        keys["optimizer.states"] = "int8"
    if kind == "adamw":
        keys["optimizer.betas"] = list(kwargs["betas"])
        keys["optimizer.eps"] = kwargs["eps"]
    else:
        keys.update({f"optimizer.{key}": kwargs[key] for key in ("momentum", "dampening", "nesterov") if key in kwargs})
    return keys


def _agreed_keys(args):
    """What the TrainingArguments say of strata's precision and device."""
    device = args.device
    keys = {"precision": _PRECISIONS[args.mixed_precision]}
    if device.type == "cuda":
        keys.update({"device.backend": "cuda", "device.index": device.index or 0})
    elif device.type == "cpu":
        keys["device.backend"] = "emulated"
    else:
        raise ValueError(f"StrataTrainer: the Trainer's device is {device}, where strata cannot compute: use a CUDA "
                         "GPU, or the CPU (TrainingArguments(use_cpu=True))")
    return keys


def _config_of(strata_config, args):
    """The engine's configuration: `strata_config`'s keys and what the TrainingArguments `args` decide (see the
    module's docstring). ValueError naming the key for one the arguments decide or disagree with."""
    items = dict(config_items(strata_config))
    decided = [key for key in items if key in _DECIDED]
    if decided:
        key = decided[0]
        raise ValueError(f"StrataTrainer: strata_config sets {key}, which the TrainingArguments decide "
                         f"({_DECIDED[key]}): leave it out of strata_config")
    optim = getattr(args.optim, "value", args.optim)
    states = items.get("optimizer.states")
    if optim in _EIGHT_BIT and states is not None and str(states).lower() != "int8":
        raise ValueError(f"StrataTrainer: strata_config's optimizer.states {states!r} disagrees with "
                         f"TrainingArguments(optim={optim!r}), an 8-bit AdamW (int8 states): leave optimizer.states "
                         "out of strata_config, or choose optim='adamw_torch'")
    agreed = _agreed_keys(args)
    for key, value in agreed.items():
        given = items.get(key)
        if given is None or (key == "device.backend" and given == "auto"):
            continue
        if str(given).lower() != str(value):
            raise ValueError(f"StrataTrainer: strata_config's {key} {given!r} disagrees with {_AGREED[key]}, which "
                             f"say {value!r}: leave {key} out of strata_config, or change the TrainingArguments")
    clipping = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else 0.0
    return {**items, **_optimizer_keys(args), **agreed,
            "gradient_accumulation_steps": args.gradient_accumulation_steps, "gradient_clipping": clipping}


def _strata_checkpoint(folder):
    """strata's checkpoint inside the Trainer's checkpoint `folder`; ValueError when it holds none."""
    path = os.path.join(folder, STRATA_CHECKPOINT)
    if not os.path.isdir(path):
        raise ValueError(f"StrataTrainer: {folder} holds no strata checkpoint (a {STRATA_CHECKPOINT}/ folder, which "
                         "StrataTrainer's checkpoints hold unless save_only_model=True): resume from a checkpoint "
                         "StrataTrainer saved. A plain Trainer's checkpoint holds the model but not strata's "
                         "optimizer states: start a new run from its model (from_pretrained)")
    return path


class StrataTrainer(transformers.Trainer):
    """A transformers.Trainer whose model, optimizer and checkpoints are strata's; ``strata_config``: the engine's
    budgets and tiers (see the module's docstring). ``trainer.strata_engine`` is the engine."""

    def __init__(self, *args, strata_config=None, **kwargs):
        given = inspect.signature(transformers.Trainer.__init__).bind(self, *args, **kwargs).arguments
        del given["self"]
        _check_inputs(given)
        if given.get("args") is None:
            given["args"] = transformers.TrainingArguments(output_dir="tmp_trainer")  # the Trainer's default
        _check_arguments(given["args"])
        config = _config_of(strata_config, given["args"])
        super().__init__(**given)
        self.strata_engine = initialize(self.model, config, param_groups=self._param_groups())

    def _param_groups(self):
        """The Trainer's two groups (create_optimizer's): weight decay on the parameters
        get_decay_parameter_names names, none on the other trainable ones."""
        decay = set(self.get_decay_parameter_names(self.model))
        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for name, p in trainable if name in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0}]
        return [group for group in groups if group["params"]]

    # --- the Trainer's seams (see the module's docstring) ----------------------------

    def _move_model_to_device(self, model, device):
        """strata places the parameters and buffers: the model stays as it is."""

    def _build_accelerator_args(self, **kwargs):
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args.update(device_placement=False, mixed_precision="no")
        return accelerator_args

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.backward = self._backward

    def _backward(self, loss, **kwargs):
        """The accelerator's backward: the loss is its micro-batch's share already (training_step's)."""
        engine = self.strata_engine
        engine.gradient_accumulation_steps = getattr(self, "current_gradient_accumulation_steps",
                                                     self.args.gradient_accumulation_steps)
        engine.backward(loss, average=False)

    def create_optimizer(self, model=None):
        optimizer = self.strata_engine.optimizer
        step = type(optimizer).step.__get__(optimizer)  # the class's: a second train() does not wrap the wrapper

        def step_and_report(closure=None):
            """The step; then whether fp16's loss scaling skipped it, told to accelerate's wrapper of the optimizer,
            whose step_was_skipped the Trainer reads before it moves the learning-rate schedule on."""
            loss = step(closure)
            if self.optimizer is not optimizer and hasattr(self.optimizer, "_is_overflow"):
                self.optimizer._is_overflow = bool(self.strata_engine.last_step.get("skipped"))
            return loss

        optimizer.step = step_and_report
        self.optimizer = optimizer
        return self.optimizer

    def _clip_grad_norm(self, model):
        """strata's step clips to max_grad_norm; the norm is known once it has run."""
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        return None

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        """As the Trainer's, with grad_norm the norm strata's step computed (before clipping)."""
        if self.control.should_log:
            grad_norm = self.strata_engine.last_step.get("grad_norm", grad_norm)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # --- checkpoints -------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir):
        """strata's checkpoint (every state) in output_dir/strata, in place of optimizer.pt; the scheduler's."""
        self.strata_engine.save_checkpoint(os.path.join(output_dir, STRATA_CHECKPOINT))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The model's values come with strata's checkpoint, loaded with the optimizer's states: here, only
        whether it is there."""
        _strata_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        self.strata_engine.load_checkpoint(_strata_checkpoint(checkpoint))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


__all__ = ["STRATA_CHECKPOINT", "StrataTrainer"]
