"""strata against plain PyTorch on random models (see differential.py): the same losses and parameters,
peaks within the budgets.

Hypothesis draws the cases: a fixed, derandomized set of STRATA_DIFF_EXAMPLES (default 100) in
scripts/test.sh; a long run draws more, from a seed of its own:

    STRATA_DIFF_EXAMPLES=2000 STRATA_DIFF_SEED=1 \\
        .venv/bin/python -m pytest -s python/tests/test_differential.py -k random_models

A failure prints the drawn case (hypothesis shrinks it first) and `run_case(Case(...))` to reproduce it.
The cases of issue 22 are fixed examples below.
"""

import os

import pytest
from hypothesis import HealthCheck, given, seed, settings, strategies as st

from differential import HALF_KERNELS, MIXED_BATCHNORM, BlockSpec, Case, build_model, replace, run_case

EXAMPLES = int(os.environ.get("STRATA_DIFF_EXAMPLES", "100"))
SEED = os.environ.get("STRATA_DIFF_SEED")


@st.composite
def block_specs(draw, kinds):
    return BlockSpec(
        kind=draw(st.sampled_from(kinds)),
        output=draw(st.sampled_from(["tensor", "tuple", "dict", "dataclass"])),
        skip=draw(st.sampled_from([0.0, 0.0, 0.3, 0.6])),
        frozen=draw(st.sampled_from([False, False, False, True])),
        inplace=draw(st.booleans()),
        checkpoint=draw(st.sampled_from(["", "", "reentrant", "non_reentrant"])))


@st.composite
def cases(draw):
    precision = draw(st.sampled_from(["fp32", "fp32", "bf16", "fp16"]))
    upcast = precision == "fp16" and not HALF_KERNELS
    kinds = ["linear", "mlp", "attention"] if upcast else ["linear", "mlp", "conv", "norm", "batchnorm", "attention"]
    if precision != "fp32" and not MIXED_BATCHNORM:
        kinds = [k for k in kinds if k != "batchnorm"]
    blocks = tuple(draw(st.lists(block_specs(kinds), min_size=1, max_size=5)))
    tokens = draw(st.booleans())
    return Case(
        seed=draw(st.integers(0, 2 ** 16)),
        width=draw(st.sampled_from([8, 12, 16, 24])),
        tokens=tokens,
        tied=tokens and draw(st.booleans()),
        blocks=blocks,
        reuse=draw(st.integers(-1, len(blocks) - 1)),
        parent_param=draw(st.booleans()),
        sometimes=draw(st.booleans()),
        precision=precision,
        upcast=upcast,
        optimizer=draw(st.sampled_from(["adamw", "adam", "sgd"])),
        lr=draw(st.sampled_from([1e-3, 1e-2])),
        weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
        accumulation=draw(st.integers(1, 3)),
        clipping=draw(st.sampled_from([0.0, 0.0, 0.5, 10.0])),
        steps=draw(st.integers(2, 5)),
        # From the least the engine's checks at initialize take (0) to room for everything (1); a refusal
        # naming a least budget is tried again there (differential.run_case).
        device_fraction=draw(st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0, 1.5])),
        host_fraction=draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0])),
        chunk_elems=draw(st.sampled_from([0, 64, 256, 1024, 4096])),
        nvme_capacity=draw(st.booleans()),
        measured=draw(st.booleans()))


def drawn(test):
    """The fixed set (derandomized), or with STRATA_DIFF_SEED draws of that seed's own."""
    test = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(test)
    return test if SEED is None else seed(int(SEED))(test)


# The share of drawn cases that must train. A refusal passes a case (its budgets are drawn down to none, and
# a refusal naming the least budget is tried again there), but a strata that refused every draw would pass
# them all. Of the fixed set 88 to 89 of 100 train; 0.7 leaves room for another seed's draws.
TRAINED_FLOOR = 0.7
# Fewer draws than this say nothing of the share (STRATA_DIFF_EXAMPLES set low for a quick run).
FLOOR_DRAWS = 20


def test_random_models_train_as_in_torch():
    outcomes = []

    @drawn
    @given(case=cases())
    def train(case):
        outcomes.append(run_case(case, refusal_ok=True) is not None)

    train()
    trained = sum(outcomes)
    print(f"\n{trained} of {len(outcomes)} random cases trained, {len(outcomes) - trained} refused their budgets")
    if len(outcomes) >= FLOOR_DRAWS:
        assert trained >= TRAINED_FLOOR * len(outcomes), \
            f"only {trained} of {len(outcomes)} random cases trained (at least {TRAINED_FLOOR:.0%} must)"


# --- the cases of issue 22 ------------------------------------------------------------

LAYER_DROP = Case(seed=3, blocks=(BlockSpec("mlp", skip=0.3),) * 4, steps=8, device_fraction=0.6, host_fraction=0.5,
                  chunk_elems=1024)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_blocks_skipped_at_random_train_as_in_torch(optimizer):
    run_case(replace(LAYER_DROP, optimizer=optimizer))


def test_a_sometimes_used_head_and_frozen_blocks_train_as_in_torch():
    run_case(Case(seed=5, blocks=(BlockSpec("conv"), BlockSpec("norm", frozen=True), BlockSpec("batchnorm")),
                  parent_param=True, sometimes=True, accumulation=2, steps=4))


def test_a_module_called_twice_needs_no_more_device_memory():
    once = Case(seed=7, width=24, blocks=(BlockSpec("mlp"), BlockSpec("linear"), BlockSpec("mlp")), chunk_elems=512,
                device_fraction=0.0, host_fraction=1.0)
    least = run_case(once)["tiers"]["device"]["capacity_bytes"]  # tried again at the least the engine names
    run_case(replace(once, reuse=0, device_budget=least), at_the_least=False)


def test_odd_sized_chunks_train_within_30_percent_of_the_model_states():
    # Every linear weight (84 x 84) exceeds the 4096-element chunk: a chunk of its own, of an odd size.
    case = Case(seed=11, width=84, blocks=(BlockSpec("linear"),) * 5, chunk_elems=4096)
    model_states = 4 * 4 * sum(p.numel() for p in build_model(case).parameters())  # fp32: params, grads, 2 states
    run_case(replace(case, device_budget=int(0.3 * model_states)))


def test_activations_do_not_count_against_the_emulated_device():
    # The device holds three quarters of the param chunks; autograd's saved activations are far larger.
    stats = run_case(Case(seed=13, width=24, blocks=(BlockSpec("mlp"),) * 3, measured=True, device_fraction=0.75,
                          chunk_elems=256, steps=5))
    assert stats["pipeline"]["planned_iterations"] > 0, stats["pipeline"].get("plan_error")


def test_a_small_model_trains_with_no_chunk_or_capacity_setting():
    run_case(Case(seed=17, tokens=True, tied=True, blocks=(BlockSpec("attention"), BlockSpec("mlp")),
                  chunk_elems=0, nvme_capacity=False, device_fraction=2.0, host_fraction=0.5))


def test_a_device_too_small_for_a_recomputation_is_refused_as_a_memory_error():
    # The non-reentrant checkpoint recomputes the conv block inside autograd's unpack hook, which passes a
    # failed pin on as a RuntimeError; the engine raises the MemoryError naming device.budget (its
    # recomputation needs 16KiB).
    case = Case(seed=11009, width=12, tokens=True, tied=True,
                blocks=(BlockSpec("conv", output="dataclass", inplace=True, checkpoint="non_reentrant"),
                        BlockSpec("mlp", output="tuple", skip=0.3, frozen=True), BlockSpec("norm", inplace=True)),
                reuse=1, optimizer="adam", lr=1e-3, weight_decay=0.1, device_budget=12 << 10, chunk_elems=0,
                measured=True)
    assert run_case(case, refusal_ok=True, at_the_least=False) is None
