"""Differential testing against plain PyTorch: random models from the building blocks real models use,
trained through strata and through torch.optim, and compared.

A `Case` is everything one example draws: the model (its blocks and what its
forward does with them), the budgets, the precision, the optimizer and the
training loop. `build_model(case)` makes the model (the same one for a seed);
`run_case(case)` trains it both ways and raises AssertionError naming what
differs, with the case to reproduce it:

    .venv/bin/python -c "import sys; sys.path.insert(0, 'python/tests'); \\
        from differential import *; run_case(Case(...))"

test_differential.py draws cases with hypothesis and holds the issue's cases as fixed examples.
"""

import copy
import dataclasses
import gc
import math
import os
import re
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import strata
from strata._strata import parse_size

BLOCK_KINDS = ("linear", "mlp", "conv", "norm", "batchnorm", "attention")
OUTPUT_KINDS = ("tensor", "tuple", "dict", "dataclass")


def _half_kernels():
    """Whether this torch computes a linear layer in fp16 on the CPU (2.x does; 1.13 does not)."""
    try:
        torch.nn.functional.linear(torch.ones(1, 2, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16))
        return True
    except RuntimeError:
        return False


def _mixed_batchnorm():
    """Whether this torch normalizes bf16 activations with fp32 running statistics on the CPU."""
    norm = torch.nn.BatchNorm1d(2)
    for p in norm.parameters():
        p.data = p.data.to(torch.bfloat16)
    try:
        norm(torch.ones(2, 2, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


HALF_KERNELS = _half_kernels()
MIXED_BATCHNORM = _mixed_batchnorm()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class BlockSpec:
    kind: str = "linear"
    output: str = "tensor"        # what the block returns: a tensor, a tuple, a dict or a dataclass
    skip: float = 0.0             # the chance the forward skips the block in a micro-batch (LayerDrop)
    frozen: bool = False          # requires_grad False on its parameters
    inplace: bool = False         # its activation is ReLU(inplace=True)
    checkpoint: str = ""          # "", "reentrant" or "non_reentrant": torch.utils.checkpoint around it


@dataclass(frozen=True)
class Case:
    seed: int = 0
    width: int = 16
    tokens: bool = False          # input: tokens through an embedding (else features through a linear)
    tied: bool = False            # tokens: the output head is the embedding's weight
    blocks: tuple = (BlockSpec(),)
    reuse: int = -1               # a block called again after the last one (-1: none)
    parent_param: bool = False    # a parameter of the root module, used in its own forward
    sometimes: bool = False       # a head used only in every other micro-batch
    precision: str = "fp32"
    optimizer: str = "adamw"
    lr: float = 1e-2
    weight_decay: float = 0.01
    accumulation: int = 1
    clipping: float = 0.0
    steps: int = 4
    device_fraction: float = 1.0  # device.budget from the least accepted (0) to room for all (1): budgets_of
    host_fraction: float = 1.0    # host.budget the same way
    device_budget: int = 0        # device.budget in bytes instead of the fraction's
    host_budget: int = 0          # host.budget in bytes instead of the fraction's
    chunk_elems: int = 1024       # chunk.size_elems; 0: no chunk setting (the engine chooses)
    nvme_capacity: bool = True    # nvme.capacity set (else the engine's default)
    measured: bool = False        # non_model_memory "measured" (else 0)
    upcast: bool = False          # linear layers compute in fp32 from their parameters (what a torch without
                                  # fp16 CPU kernels trains fp16 parameters with); linear blocks only


# --- the model -------------------------------------------------------------------


@dataclass
class Hidden:
    """A block's output as a dataclass."""
    h: torch.Tensor


class UpcastLinear(torch.nn.Linear):
    """A linear layer that computes in fp32 whatever its parameters' dtype."""

    def forward(self, x):
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)


def _act(spec):
    return torch.nn.ReLU(inplace=True) if spec.inplace else torch.nn.Tanh()


class Block(torch.nn.Module):
    """One building block on hidden states (batch, seq, width), residual where it computes a new value."""

    def __init__(self, spec, width, upcast):
        super().__init__()
        self.spec = spec
        Linear = UpcastLinear if upcast else torch.nn.Linear
        if spec.kind == "linear":
            self.fc = Linear(width, width)
            self.act = _act(spec)
        elif spec.kind == "mlp":  # an odd hidden width: chunk-sized and odd-sized parameters
            self.up = Linear(width, 3 * width + 5)
            self.act = _act(spec)
            self.down = Linear(3 * width + 5, width)
        elif spec.kind == "conv":
            self.conv = torch.nn.Conv1d(width, width, kernel_size=3, padding=1)
        elif spec.kind == "norm":
            self.norm = torch.nn.LayerNorm(width)
        elif spec.kind == "batchnorm":  # running statistics: buffers that change in every training forward
            self.norm = torch.nn.BatchNorm1d(width)
        elif spec.kind == "attention":  # no bias: the softmax cancels a key bias (its gradient is rounding noise)
            self.qkv = Linear(width, 3 * width, bias=False)
            self.proj = Linear(width, width, bias=False)
        if spec.frozen:
            for p in self.parameters():
                p.requires_grad_(False)

    def compute(self, x):
        # Residual and nonlinear after a bias, so that no bias gets a gradient that is zero but for
        # rounding (a normalization right after a bias cancels it), which Adam would turn into full steps.
        kind = self.spec.kind
        if kind == "linear":
            return x + 0.5 * self.act(self.fc(x))
        if kind == "mlp":
            return x + self.down(self.act(self.up(x)))
        if kind == "conv":
            return x + torch.tanh(self.conv(x.transpose(1, 2)).transpose(1, 2))
        if kind == "norm":
            return self.norm(x)
        if kind == "batchnorm":
            return x + torch.tanh(self.norm(x.reshape(-1, x.shape[-1])).reshape(x.shape))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        return x + self.proj(weights @ v)

    def forward(self, x):
        y = self.compute(x)
        if self.spec.output == "tuple":
            return y, y.detach().sum()
        if self.spec.output == "dict":
            return {"h": y}
        if self.spec.output == "dataclass":
            return Hidden(y)
        return y


def _hidden(output):
    if isinstance(output, tuple):
        return output[0]
    if isinstance(output, dict):
        return output["h"]
    if isinstance(output, Hidden):
        return output.h
    return output


class Net(torch.nn.Module):
    """The drawn model. `position` (set before each forward) picks the micro-batch's skip mask."""

    def __init__(self, case):
        super().__init__()
        self.case, self.position = case, 0
        w = case.width
        self.vocab = 2 * w + 3
        Linear = UpcastLinear if case.upcast else torch.nn.Linear
        if case.tokens:
            self.embed = torch.nn.Embedding(self.vocab, w)
            self.head = Linear(w, self.vocab, bias=not case.tied)
            if case.tied:
                self.head.weight = self.embed.weight
        else:
            self.embed = Linear(5, w)
            self.head = Linear(w, 2)
        self.blocks = torch.nn.ModuleList(Block(spec, w, case.upcast) for spec in case.blocks)
        if case.parent_param:
            self.scale = torch.nn.Parameter(torch.ones(w) + 0.1 * torch.randn(w))
        if case.sometimes:
            self.aux = Linear(w, w)
        generator = torch.Generator().manual_seed(case.seed + 1)
        draws = torch.rand(case.steps * case.accumulation, len(case.blocks), generator=generator)
        self.keep = [[draw >= spec.skip for draw, spec in zip(row.tolist(), case.blocks)] for row in draws]

    def run_block(self, block, x):
        if block.spec.checkpoint and torch.is_grad_enabled():
            reentrant = block.spec.checkpoint == "reentrant"
            if reentrant:  # tensors only through the reentrant form
                return torch.utils.checkpoint.checkpoint(lambda h: _hidden(block(h)), x, use_reentrant=True)
            return _hidden(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
        return _hidden(block(x))

    def forward(self, inputs, targets):
        x = self.embed(inputs)
        if self.case.upcast:
            x = x.float()
        keep = self.keep[self.position % len(self.keep)] if self.training else [True] * len(self.blocks)
        for block, kept in zip(self.blocks, keep):
            if kept:
                x = self.run_block(block, x)
        if self.case.reuse >= 0:
            x = self.run_block(self.blocks[self.case.reuse], x)
        if self.case.parent_param:
            x = x * self.scale
        if self.case.sometimes and self.position % 2 == 0:
            x = x + torch.tanh(self.aux(x))
        out = self.head(x).float()
        if self.case.tokens:
            return F.cross_entropy(out.reshape(-1, self.vocab), targets.reshape(-1))
        return ((out - targets) ** 2).mean()


def build_model(case):
    torch.manual_seed(case.seed)
    return Net(case)


def net_loss(run, model, position, batch):
    """The drawn model's loss of `batch` (inputs, targets) through `run` (the model or its engine), as micro-batch
    `position` (None: an evaluation, the skip mask as it was)."""
    if position is not None:
        model.position = position
    return run(*batch)


def batches(case, count):
    """`count` micro-batches: (inputs, targets), the inputs in the dtype the model computes in."""
    generator = torch.Generator().manual_seed(case.seed + 2)
    dtype = torch.float32 if case.upcast else DTYPES[case.precision]
    out = []
    for _ in range(count):
        if case.tokens:
            tokens = torch.randint(0, 2 * case.width + 3, (3, 7), generator=generator)
            out.append((tokens[:, :-1], tokens[:, 1:]))
        else:
            inputs = torch.randn(3, 6, 5, generator=generator).to(dtype)
            out.append((inputs, torch.randn(3, 6, 2, generator=generator)))
    return out


@dataclass(frozen=True)
class Workload:
    """What a case trains: `build(case)` makes the model (the same one for a case), `batches(case, count)` its
    micro-batches, `loss(run, model, position, batch)` one's loss (see net_loss). The drawn Net by default."""
    build: object = build_model
    batches: object = batches
    loss: object = net_loss


NET = Workload()


# --- the two trainings --------------------------------------------------------------


def _optimizer(case, params, fused=False):
    kernel = {"fused": True} if fused else {}  # torch's CPU fused kernels: 2.4 on (no argument before 2.3 for SGD)
    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=case.lr, weight_decay=case.weight_decay, **kernel)
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=case.lr, weight_decay=case.weight_decay, **kernel)
    return torch.optim.SGD(params, lr=case.lr, momentum=0.9, weight_decay=case.weight_decay, **kernel)


LOSS_SCALE = 2.0 ** 10  # fp16: the loss scale of both trainings (it grows on neither within a run)


def torch_training(case, model, data, loss_of=net_loss, fused=False):
    """Plain PyTorch: torch.optim on the model (fp32), or on fp32 masters of a bf16/fp16 model that computes
    (the mixed-precision recipe; fp16 with a fixed loss scale, a step with inf/NaN gradients skipped).
    Returns the micro-batch losses and an evaluation's after, and the model's parameters after (the masters
    under bf16/fp16). `loss_of(run, model, position, batch)`: a micro-batch's loss (see net_loss); `fused`:
    torch.optim's fused kernel (True) or its default one."""
    dtype = DTYPES[case.precision]
    trainable = [p for p in model.parameters() if p.requires_grad]
    if dtype == torch.float32:
        masters = trainable
    else:
        masters = [p.detach().clone().float().requires_grad_() for p in trainable]
        for p in model.parameters():
            p.data = p.data.to(dtype)
    opt = _optimizer(case, masters, fused)
    scale = LOSS_SCALE if case.precision == "fp16" else 1.0
    losses = []
    for i, batch in enumerate(data):
        loss = loss_of(model, model, i, batch)
        losses.append(loss.item())
        (loss * (scale / case.accumulation)).backward()
        if (i + 1) % case.accumulation:
            continue
        if dtype != torch.float32:
            for master, p in zip(masters, trainable):
                master.grad = None if p.grad is None else p.grad.float() / scale
                p.grad = None
        grads = [m.grad for m in masters if m.grad is not None]
        if all(torch.isfinite(g).all() for g in grads):
            if case.clipping:
                torch.nn.utils.clip_grad_norm_(masters, case.clipping)
            opt.step()
        opt.zero_grad(set_to_none=True)
        if dtype != torch.float32:
            with torch.no_grad():
                for master, p in zip(masters, trainable):
                    p.copy_(master)
    losses.append(evaluation(model, model, data[0], loss_of))
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return losses, dict(zip(names, [m.detach() for m in masters]))


def evaluation(run, model, batch, loss_of=net_loss):
    """The loss of `batch` in eval mode without autograd (BatchNorm's running statistics at work), last of the
    losses compared."""
    run.eval()
    with torch.no_grad():
        loss = loss_of(run, model, None, batch).item()
    run.train()
    return loss


def budgets_of(case, model, nvme_dir):
    """(device.budget, host.budget) of the case: each from the least the engine's checks at initialize take
    (fraction 0: the largest param or grad chunk on the device, the largest group's chunks on the host) to
    room for all it could hold there (fraction 1), read from the layout of an engine made for a copy of
    `model` with room for everything (then let go). `case.device_budget` and `case.host_budget`, when set,
    are the budgets instead."""
    probe_dir = os.path.join(nvme_dir, "probe")
    os.mkdir(probe_dir)
    config = config_of(case, model, probe_dir, budgets=None)
    chunks = strata.initialize(copy.deepcopy(model), config).engine.chunks()
    on_device = [c["size_bytes"] for c in chunks if c["kind"] in ("param", "grad")]
    groups = {}
    for c in chunks:
        groups[c["group"]] = groups.get(c["group"], 0) + c["size_bytes"]
    device = max(on_device) + case.device_fraction * (sum(on_device) - max(on_device))
    host = max(groups.values()) + case.host_fraction * (sum(groups.values()) - max(groups.values()))
    return case.device_budget or int(device), case.host_budget or int(host)


def config_of(case, model, nvme_dir, budgets):
    """The case's config; `budgets`: (device, host) in bytes, or None for room for everything."""
    if budgets is None:
        room = 64 * sum(p.numel() for p in model.parameters()) * 4 + (1 << 20)
        budgets = (room, room)
    config = {
        "precision": case.precision,
        "optimizer": {"type": case.optimizer, "lr": case.lr, "weight_decay": case.weight_decay,
                      "momentum": 0.9 if case.optimizer == "sgd" else 0.0},
        "device": {"backend": "emulated", "budget": budgets[0]},
        "host": {"budget": budgets[1]},
        "nvme": {"dirs": [nvme_dir]},
        "gradient_accumulation_steps": case.accumulation,
        "gradient_clipping": case.clipping,
        "non_model_memory": "measured" if case.measured else 0,
        "log": {"level": "error"},
    }
    if case.nvme_capacity:
        config["nvme"]["capacity"] = "64MiB"
    if case.chunk_elems:
        config["chunk"] = {"size_elems": case.chunk_elems}
    if case.precision == "fp16":
        config["loss_scale"] = {"mode": "dynamic", "init": LOSS_SCALE, "growth_interval": 1000}
    return config


class Refused(Exception):
    """The engine refused the case's budgets (at initialize or in the first iteration), with its reason."""


def _refusal(error):
    """Whether `error` refuses the budgets: a ValueError or MemoryError naming the setting to raise (room in
    pieces is no refusal: the pinned chunks fit the budget)."""
    text = str(error)
    return isinstance(error, (ValueError, MemoryError)) and "in pieces" not in text and any(
        key in text for key in ("device.budget", "host.budget", "nvme.capacity"))


def dynamic(case):
    """Whether the case's forwards differ between micro-batches (blocks skipped, a head used in some): a later
    one may need more than the first, and a refusal then is the engine's first chance."""
    return case.sometimes or any(spec.skip > 0 for spec in case.blocks)


def strata_training(case, model, data, nvme_dir, loss_of=net_loss):
    """The same training through strata. Returns the losses (an evaluation's last), the parameters (masters
    under bf16/fp16), the engine's stats and its config. Raises Refused when the engine refuses the budgets
    at initialize or in the first iteration (or any, the evaluation's too, for a dynamic case), naming the
    setting to raise."""
    config = config_of(case, model, nvme_dir, budgets_of(case, model, nvme_dir))
    try:
        engine = strata.initialize(model, config)
    except (ValueError, MemoryError) as error:
        if _refusal(error):
            raise Refused(str(error)) from error
        raise
    losses = []

    def refusing(first, work):
        try:
            return work()
        except MemoryError as error:
            if (first or dynamic(case)) and _refusal(error):
                raise Refused(str(error)) from error
            raise

    def iteration(i, batch):
        loss = loss_of(engine, model, i, batch)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()

    for i, batch in enumerate(data):
        refusing(i < case.accumulation, lambda: iteration(i, batch))  # the first iteration, its step too
    # The evaluation runs every block: a dynamic case's training may never have used some of them at once.
    losses.append(refusing(False, lambda: evaluation(engine, model, data[0], loss_of)))
    state = engine.state_dict(master=case.precision != "fp32")
    return losses, state, engine.stats(), config


# Relative tolerances of losses and parameters. fp32 is PyTorch's arithmetic. bf16/fp16 compute in 8/11
# significant bits: a master a last fp32 bit off torch's (the fused update rounds as torch's separate
# operations do not, bit for bit) may round to the neighbouring bf16/fp16 value, and what follows differs.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}


def param_atol(case):
    """What a settled element of a parameter may differ by besides TOLERANCE (relative to it): fp32 (the fused
    update's arithmetic is torch's to within its last bit): a tenth of an Adam step (about lr whatever the
    gradient's size); bf16/fp16 (a master a bit off rounds to another 8/11-bit value): a full step each step.
    The whole tensor is held to TOLERANCE (relative, by norm) besides."""
    return 0.1 * case.lr if case.precision == "fp32" else case.lr * case.steps


def noise_atol(case):
    """What an unsettled element (see unsettled()) may differ by: its gradient is rounding noise, so each training
    takes Adam steps of about lr a step in directions a last bit decides, and two such walks of `steps` steps end
    at most 2 lr a step apart (momentum: lr a step too, or so)."""
    return 2 * case.lr * case.steps


def _close(a, b, rtol):
    return abs(a - b) <= rtol * max(abs(b), 1e-3)


_LEAST = re.compile(r"raise (device|host)\.budget to at least ([0-9.]+ ?[KMGT]?i?B)")


def _train_at_the_least(case, workload, data, nvme_dir, tries):
    """strata's training of `case` (see strata_training), and the case it trained. A refusal that names the
    least budget that would do is tried again at that budget (so the tightest budget the engine accepts is
    trained at), up to `tries` times in all; then its Refused is raised."""
    def attempt(number, case):
        attempt_dir = os.path.join(nvme_dir, str(number))
        os.mkdir(attempt_dir)
        return case, strata_training(case, workload.build(case), data, attempt_dir, workload.loss)

    for number in range(tries - 1):
        try:
            return attempt(number, case)
        except Refused as error:
            least = _LEAST.search(str(error))
            if least is None:
                raise
            case = replace(case, **{f"{least.group(1)}_budget": parse_size(least.group(2).replace(" ", ""))})
    return attempt(tries - 1, case)


def run_case(case, refusal_ok=False, at_the_least=True, workload=NET):
    """Trains `case` both ways and asserts the same losses and parameters, and peaks within the budgets.
    Returns the engine's stats after, with "parity": the largest relative difference of a loss ("loss") and of a
    parameter ("param", by norm); or None when `refusal_ok` and the engine refused the budgets (else that is a
    failure too). `at_the_least`: a refusal naming the least budget that would do is tried again there.
    `workload`: the model and data the case trains (the drawn Net by default)."""
    data = workload.batches(case, case.steps * case.accumulation)
    reference = workload.build(case)
    with tempfile.TemporaryDirectory() as nvme_dir:
        try:
            case, (ours, state, stats, config) = _train_at_the_least(case, workload, data, nvme_dir,
                                                                     4 if at_the_least else 1)
        except Refused as error:
            if refusal_ok:
                return None
            raise AssertionError(f"refused: {error}\nreproduce: run_case({case!r})") from error
        except Exception as error:
            raise AssertionError(f"{type(error).__name__}: {error}\nreproduce: run_case({case!r})") from error
        finally:
            gc.collect()  # the engines (the probe's too) hold their NVMe files open until they are collected
    theirs, params = torch_training(case, reference, data, workload.loss)
    unsettled_elements = unsettled(case, workload, data, params)
    where = f"\nreproduce: run_case({case!r})"
    parity = _compare(case, (ours, state), (theirs, params), unsettled_elements, where)
    for tier in ("device", "host"):  # the tier's arena is its budget: nothing is held beside it
        usage, budget = stats["tiers"][tier], config[tier]["budget"]
        assert usage["peak_bytes"] <= usage["capacity_bytes"] <= budget, f"{tier}: {usage}, budget {budget}{where}"
    stats["parity"] = parity
    return stats


def unsettled(case, workload, data, params):
    """The elements of each parameter on which torch disagrees with itself: the reference's training again with
    torch.optim's fused kernel puts them further apart than the tolerance (relative to the parameter's root mean
    square). Adam's step is about lr whatever the gradient's size, so an element whose gradient is rounding noise
    (an attention key's bias, which the softmax cancels) or as small as Adam's eps (an expert first reached)
    takes a step that a last bit decides. Under bf16/fp16 the fused kernel's last-bit differences round a parameter
    to another 8/11-bit value now and then, and the noise of every such gradient differs from there on: the same
    elements come out unsettled. {name: boolean mask}, for the parameters that have such elements. SGD has none:
    its step is as small as the gradient, noise's too."""
    if case.optimizer == "sgd":
        return {}
    _, twin = torch_training(case, workload.build(case), data, workload.loss, fused=True)
    rtol, out = TOLERANCE[case.precision], {}
    for name, value in params.items():
        value = value.float()
        rms = value.norm() / math.sqrt(max(value.numel(), 1))
        mask = (twin[name].float() - value).abs() > rtol * rms
        if mask.any():
            out[name] = mask
    return out


def _compare(case, strata_run, torch_run, unsettled_elements, where):
    """Asserts the same losses (within TOLERANCE, relative) and parameters: each tensor by norm within TOLERANCE
    over its settled elements, each settled element within param_atol besides and each unsettled one within
    noise_atol (`unsettled_elements`, see unsettled()). Returns the largest differences: "loss", "param"
    (relative, by norm), and "unsettled" (how many elements the norm left out)."""
    (ours, state), (theirs, params) = strata_run, torch_run
    rtol = TOLERANCE[case.precision]
    assert len(ours) == len(theirs), f"{len(ours)} losses from strata, {len(theirs)} from torch{where}"
    parity = {"loss": 0.0, "param": 0.0, "unsettled": 0}
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert _close(a, b, rtol), f"loss {i}: strata {a!r}, torch {b!r} (relative tolerance {rtol}){where}"
        parity["loss"] = max(parity["loss"], abs(a - b) / max(abs(b), 1e-3))
    for name, value in params.items():
        mine, value = state[name].float(), value.float()
        noise = unsettled_elements.get(name, torch.zeros(value.shape, dtype=torch.bool))
        error = (mine - value).abs() - rtol * value.abs()
        atol = torch.where(noise, noise_atol(case), param_atol(case))
        assert error.numel() == 0 or (error <= atol).all().item(), \
            f"parameter {name}: an element differs by {(mine - value).abs().max().item():.3g}{where}"
        kept = ~noise
        parity["unsettled"] += int(noise.sum())
        relative = ((mine[kept] - value[kept]).norm() / value[kept].norm().clamp(min=1e-12)).item()
        assert relative <= rtol, f"parameter {name}: relative error {relative:.3g} (tolerance {rtol}){where}"
        parity["param"] = max(parity["param"], relative)
    return parity


def replace(case, **changes):
    return dataclasses.replace(case, **changes)
