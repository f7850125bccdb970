"""Configurations: a dict, or the path of a JSON file, read into the engine's options.

Keys are the engine's (``strata options`` lists them; nested objects and dotted
keys both work) plus the adapter's own:

- ``optimizer``: ``type`` (adamw, adam or sgd), ``lr``, ``betas`` ([beta1, beta2]),
  ``eps``, ``weight_decay``, ``momentum``, and the engine's other ``optimizer.*`` keys;
- ``gradient_accumulation_steps``: micro-batches per optimizer step (an int >= 1);
- ``accumulation``: the order ``engine.train_step`` runs a step's micro-batches in:
  ``"standard"`` (default: each micro-batch's forward and backward in turn) or
  ``"layered"`` (each repeated block for every micro-batch in a row: strata.layered);
  ``accumulation_blocks``: the name of the model's ``nn.ModuleList`` of blocks
  (default: found); ``accumulation_checkpoint``: layered blocks recompute in
  backward, holding only their inputs (default true; false where the model
  checkpoints them itself); ``accumulation_offload``: host memory for the
  layered blocks' held inputs (a size; default 0: they stay where the model
  computes), a step that needs more refused as it begins;
- ``gradient_clipping``: the global norm gradients are clipped to (0: none);
- ``non_model_memory``: device memory each moment uses besides chunks, for the
  planner: ``"measured"`` (default: ``torch.cuda.memory_allocated()`` on a GPU;
  0 on the host-emulated device, whose tier holds chunks only: activations stay
  in process memory), or a size (bytes, or a string like ``"64MiB"``) taken as
  the same at every moment.

An unknown key or a bad value raises ValueError naming the key and what is allowed.
"""

import json
import os
from dataclasses import dataclass, field

from ._strata import Options, parse_size


@dataclass
class Config:
    options: Options = field(default_factory=Options)
    gradient_accumulation_steps: int = 1
    non_model_memory: object = None  # None: measured; else bytes
    accumulation: str = "standard"   # engine.train_step's order: standard or layered
    accumulation_blocks: str = None  # the blocks' ModuleList's name; None: found
    accumulation_checkpoint: bool = True
    accumulation_offload: int = 0    # host bytes for the layered blocks' held inputs (0: kept where computed)

    def describe(self):
        values = dict(self.options.describe())
        values["gradient_accumulation_steps"] = str(self.gradient_accumulation_steps)
        values["accumulation"] = self.accumulation
        values["accumulation_blocks"] = self.accumulation_blocks or "found"
        values["accumulation_checkpoint"] = _text(self.accumulation_checkpoint)
        values["accumulation_offload"] = str(self.accumulation_offload)
        values["non_model_memory"] = "measured" if self.non_model_memory is None else str(self.non_model_memory)
        return values

    def wait_timeout_seconds(self):
        """The longest the engine waits for one thing before it is an error, as its C++ waits take it."""
        return self.options.wait_timeout_ms() / 1000


def _text(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_text(v) for v in value)
    return str(value)


def _flatten(prefix, value, out):
    if isinstance(value, dict):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise ValueError(f"config: key {key!r} under {prefix or 'the top level'!r} is not a string")
            _flatten(f"{prefix}.{key}" if prefix else key, inner, out)
    else:
        out.append((prefix, value))


def _size(value, key, other):
    """A size in the config: bytes, or a string like "64MiB"."""
    message = f"config: {key} {value!r} must be {other} or a size (bytes, or like \"64MiB\")"
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, int) and value < 0):
        raise ValueError(message)
    if isinstance(value, int):
        return value
    try:
        return parse_size(value)
    except ValueError:
        raise ValueError(message) from None


def _non_model_memory(value):
    if value == "measured":
        return None
    return _size(value, "non_model_memory", '"measured"')


ACCUMULATION_MODES = ("standard", "layered")


def accumulation_mode(value, what):
    if value not in ACCUMULATION_MODES:
        raise ValueError(f"{what} {value!r} must be one of {', '.join(map(repr, ACCUMULATION_MODES))}")
    return value


def config_items(config=None):
    """`config` (a dict, a path to a JSON file, or None for the defaults) as its (dotted key, value) pairs."""
    if config is None:
        config = {}
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except OSError as error:
            raise ValueError(f"config: cannot read {path}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"config: {path} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"config: expected a dict or the path of a JSON file, got {type(config).__name__}")
    pairs = []
    _flatten("", config, pairs)
    return pairs


def load_config(config=None):
    """Reads `config` (a dict, a path to a JSON file, or None for the defaults) into a Config."""
    result = Config()
    for key, value in config_items(config):
        if key == "gradient_accumulation_steps":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config: gradient_accumulation_steps {value!r} must be an int >= 1")
            result.gradient_accumulation_steps = value
        elif key == "accumulation":
            result.accumulation = accumulation_mode(value, "config: accumulation")
        elif key == "accumulation_blocks":
            if not isinstance(value, str) or not value:
                raise ValueError(f"config: accumulation_blocks {value!r} must be the name of the model's "
                                 "torch.nn.ModuleList of blocks, as model.named_modules() names it")
            result.accumulation_blocks = value
        elif key == "accumulation_checkpoint":
            if not isinstance(value, bool):
                raise ValueError(f"config: accumulation_checkpoint {value!r} must be true or false")
            result.accumulation_checkpoint = value
        elif key == "accumulation_offload":
            result.accumulation_offload = _size(value, "accumulation_offload", "0 (held where the model computes)")
        elif key == "non_model_memory":
            result.non_model_memory = _non_model_memory(value)
        elif key == "gradient_clipping":
            result.options.set("optimizer.max_grad_norm", _text(value))
        elif key == "optimizer.type":
            result.options.set("optimizer.kind", _text(value))
        elif key == "optimizer.betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ValueError(f"config: optimizer.betas {value!r} must be two numbers [beta1, beta2]")
            result.options.set("optimizer.beta1", _text(value[0]))
            result.options.set("optimizer.beta2", _text(value[1]))
        else:
            result.options.set(key, _text(value))
    result.options.validate()
    return result
