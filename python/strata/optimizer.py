"""The engine's optimizer as a ``torch.optim.Optimizer``: param groups that schedulers and users drive.

    engine = strata.initialize(model, config, param_groups=[{"params": decay, "weight_decay": 0.01},
                                                            {"params": no_decay, "weight_decay": 0.0}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warmup)
    engine.backward(loss); engine.optimizer.step(); scheduler.step()

Each param group's tensors lie in chunks of their own, so that a chunk's fused
update uses one group's values (Note [Param groups] in optim/optimizer.cc). The
values are read from ``param_groups`` at every step and set on strata's C++
optimizer, which validates them, so a scheduler's or a user's change to
``group["lr"]`` takes effect at the next step, as with torch.optim.

The groups are fixed at initialize (they decide the chunk layout): from
``param_groups`` (torch's list of dicts, parameters given as nn.Parameters or by
name), else from the config's ``optimizer.no_decay`` rule, else one group.
"""

import re

import torch

# The keys strata reads from a param group, by optimizer kind.
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

# optimizer.no_decay's rules as the Hugging Face Trainer decides them
# (Trainer.get_decay_parameter_names): a lowercased parameter name matching
# one of a rule's patterns, or, for "norm", a parameter of an nn.LayerNorm.
_NO_DECAY_PATTERNS = {
    "bias": [r"bias"],
    "norm": [r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"],
}


def _no_decay_rules(config):
    text = config.options.describe()["optimizer.no_decay"]
    return [rule for rule in text.split(",") if rule]


def _no_decay_params(model, rules):
    """The ids of the parameters `rules` (a list of bias, norm) keep from weight decay."""
    patterns = [re.compile(p) for rule in rules for p in _NO_DECAY_PATTERNS[rule]]
    chosen = {id(p) for name, p in model.named_parameters() if any(x.search(name.lower()) for x in patterns)}
    if "norm" in rules:
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                chosen.update(id(p) for p in module.parameters())
    return chosen


def _names(model):
    """Every name of every parameter (tied ones under each of theirs) -> the parameter; its first name by id."""
    by_name, first_name = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_name[name] = p
        first_name.setdefault(id(p), name)
    return by_name, first_name


def _listed(params):
    if isinstance(params, (torch.Tensor, str)):
        return [params]
    try:
        return list(params)
    except TypeError:
        raise ValueError(f"strata.initialize: a param group's 'params' must be a parameter, a name or a list of "
                         f"them, got {type(params).__name__}") from None


def _resolve_param(item, where, by_name, first_name):
    if isinstance(item, str):
        if item not in by_name:
            some = ", ".join(list(by_name)[:3])
            raise ValueError(f"strata.initialize: {where} names '{item}', which is no parameter of the model "
                             f"(its parameters are named like {some})")
        return by_name[item]
    if isinstance(item, torch.Tensor):
        if id(item) not in first_name:
            raise ValueError(f"strata.initialize: {where} holds a tensor of shape {tuple(item.shape)} that is no "
                             "parameter of the model")
        return item
    raise ValueError(f"strata.initialize: {where} holds a {type(item).__name__}: expected nn.Parameters or their "
                     "names")


def _place(item, index, group_of, by_name, first_name):
    """Parameter `item` of param_groups[index] into `group_of`, once."""
    where = f"param_groups[{index}]"
    p = _resolve_param(item, where, by_name, first_name)
    name = first_name[id(p)]
    if not p.requires_grad:
        raise ValueError(f"strata.initialize: {where} holds '{name}', which is frozen (requires_grad=False): "
                         "frozen parameters have no optimizer state and belong to no group; leave it out")
    if group_of.get(id(p), index) != index:
        raise ValueError(f"strata.initialize: '{name}' is in param_groups[{group_of[id(p)]}] and {where}: "
                         "each trainable parameter belongs to exactly one group")
    group_of[id(p)] = index


def _given_groups(model, param_groups):
    """`param_groups` checked: each group's options (without params) and {id(parameter): group index}."""
    if not isinstance(param_groups, (list, tuple)) or not param_groups or \
            not all(isinstance(g, dict) and "params" in g for g in param_groups):
        raise ValueError("strata.initialize: param_groups must be a non-empty list of dicts, each with 'params' "
                         "(as torch.optim takes them: [{'params': [...], 'weight_decay': 0.0}, ...])")
    names = _names(model)
    group_of, options = {}, []
    for index, group in enumerate(param_groups):
        for item in _listed(group["params"]):
            _place(item, index, group_of, *names)
        options.append({key: value for key, value in group.items() if key != "params"})
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"strata.initialize: trainable parameters in no param group: {', '.join(missing[:5])}{more}: "
                         "every trainable parameter belongs to exactly one group")
    return options, group_of


def param_groups_of(model, param_groups, config):
    """The groups strata lays the model out by: each group's options (without params), and {id(parameter):
    group index} for the trainable parameters. See the module's docstring for where they come from."""
    rules = _no_decay_rules(config)
    if param_groups is not None:
        if rules:
            raise ValueError("strata.initialize: param_groups and the config's optimizer.no_decay both say which "
                             "parameters decay: give one of them")
        return _given_groups(model, param_groups)
    if not rules:
        return [{}], {}
    no_decay = _no_decay_params(model, rules)
    group_of = {id(p): 1 if id(p) in no_decay else 0 for p in model.parameters() if p.requires_grad}
    return [{}, {"weight_decay": 0.0}], group_of


class Optimizer(torch.optim.Optimizer):
    """strata's optimizer as torch.optim sees it: ``param_groups`` with each group's ``params`` and
    hyperparameters (lr, weight_decay, and betas and eps for adamw/adam, or momentum, dampening and nesterov
    for sgd), read at every step. ``step()`` is the engine's step; ``zero_grad()`` does nothing, as gradients
    live in strata's grad chunks, which each step zeroes. ``state`` is empty: the moments are in the chunks
    (engine.save_checkpoint saves them)."""

    def __init__(self, engine, groups, core, kind, defaults):
        self._engine = engine
        self._core = core
        self._keys = keys_of(kind)
        self._stepped = False  # whether the last step() updated (engine.step() returns it)
        self._fixed = False
        super().__init__(groups, {key: defaults[key] for key in self._keys})  # the config's values
        self._fixed = True
        self.write_groups()

    def add_param_group(self, param_group):
        if self._fixed:
            raise RuntimeError("engine.optimizer.add_param_group: strata's param groups are fixed at "
                               "strata.initialize (they decide the chunk layout): pass them there as param_groups")
        super().add_param_group(param_group)

    def step(self, closure=None):
        """The engine's step (engine.step()): the update once gradient_accumulation_steps backwards are in.
        Returns the closure's loss, if one is given (called with autograd on before the step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepped = self._engine._step()
        return loss

    def close(self):
        """The engine closed: strata's optimizer (and the host memory it holds) let go; step() raises after."""
        self._core = None

    def zero_grad(self, set_to_none=True):
        """Nothing to do: gradients are added into strata's grad chunks (a parameter's .grad stays None) and each
        step zeroes them; accumulating over micro-batches is the config's gradient_accumulation_steps."""

    def write_groups(self):
        """Every group's values as ``param_groups`` holds them now onto strata's optimizer, for the next update.
        ValueError naming the group and the key for a value out of range (nothing set then)."""
        write_groups(self._core, self._keys, self.param_groups)

    def read_groups(self):
        """strata's optimizer's values into ``param_groups`` (after a checkpoint restored them)."""
        for index, group in enumerate(self.param_groups):
            saved = self._core.group(index)
            group.update({key: saved[key] for key in self._keys})



def keys_of(kind):
    """The hyperparameters a param group of optimizer.kind `kind` holds."""
    return _SGD_KEYS if kind == "sgd" else _ADAM_KEYS


def write_groups(core, keys, groups):
    """Each of `groups`' values (``keys`` of each, the ones a group leaves out as `core` holds them) onto `core`,
    strata's optimizer. ValueError naming the group and the key for a value out of range (nothing set then);
    strata.initialize calls it with its param_groups before it touches the model."""
    before = [core.group(index) for index in range(len(groups))]
    values = [_values(keys, index, group, dict(before[index])) for index, group in enumerate(groups)]
    for index, value in enumerate(values):
        try:
            core.set_group(index, **value)
        except ValueError as error:
            for restore, old in enumerate(before[:index]):
                core.set_group(restore, **old)
            raise ValueError(f"engine.optimizer.param_groups[{index}]: {error}") from None


def _values(keys, index, group, values):
    """`values` (the group's as strata's optimizer holds them) with `group`'s own, checked."""
    for key in keys:
        value = group.get(key, values[key])
        where = f"engine.optimizer.param_groups[{index}]['{key}']"
        if key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise TypeError(f"{where}: {value!r} must be two numbers (beta1, beta2)")
            values[key] = (_number(value[0], where), _number(value[1], where))
        elif key == "nesterov":
            values[key] = bool(value)
        else:
            values[key] = _number(value, where)
    return values


def _number(value, where):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{where}: {value!r} must be a number")
