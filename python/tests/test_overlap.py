"""optimizer.overlap: each chunk group's update begins in backward once its gradients are final, and the step
confirms it or redoes it from the copy it kept (Note [Overlapped updates] in offload/training/overlap_updates.cc).
Whatever the step decides (a clip, an overflow, a gradient that came late), the parameters and optimizer states are
those of the same run without overlap, bit for bit."""

import pytest
import torch
import torch.utils.checkpoint

import strata
from models import TinyGPT, batches, three_tiers


def gpt_run(tmp_path, overlap, steps=5, accumulation=1, schedule=False, backwards=1, evaluate=False, states="fp32",
            **config):
    """`backwards` a step (more than the accumulation asks: the later ones add to the gradients); `evaluate`: a
    no_grad forward between the last backward and the step; `schedule`: the lr changed after every step; `states`:
    optimizer.states."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = {"overlap": "64MiB" if overlap else 0, "states": states}
    engine = strata.initialize(model, three_tiers(tmp_path, optimizer=optimizer,
                                                  gradient_accumulation_steps=accumulation, **config))
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda k: 1 / (k + 1)) if schedule else None
    reports = []
    for tokens in batches(steps * accumulation):
        for _ in range(backwards):
            logits = engine(tokens[:, :-1])
            engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
        if evaluate:
            with torch.no_grad():
                engine(tokens[:, :-1])
        if engine.step():
            reports.append(engine.last_step)
            if scheduler is not None:
                scheduler.step()
    state = {**engine.state_dict(master=engine.dtype != torch.float32), **optimizer_states(engine)}
    tiers = engine.chunk_tiers()
    engine.close()
    return state, reports, tiers


def optimizer_states(engine):
    """Every exp_avg and exp_avg_sq chunk's bytes, by chunk id."""
    out = {}
    for chunk in engine.engine.chunks():
        if chunk["kind"] in ("exp_avg", "exp_avg_sq"):
            out[f"chunk {chunk['id']}"] = torch.tensor(bytearray(engine.engine.read_chunk(chunk["id"])))
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("clip,states", [(0.0, "fp32"), (0.05, "fp32"), (0.05, "bf16"), (0.0, "int8"), (0.05, "int8")])
def test_overlapped_updates_give_the_steps_results_bit_for_bit(tmp_path, clip, states):
    (tmp_path / "after").mkdir()
    (tmp_path / "overlapped").mkdir()
    after, after_reports, _ = gpt_run(tmp_path / "after", False, gradient_clipping=clip, states=states)
    overlapped, reports, tiers = gpt_run(tmp_path / "overlapped", True, gradient_clipping=clip, states=states)
    assert_same(after, overlapped)
    assert "nvme" in tiers["exp_avg"] or "nvme" in tiers["exp_avg_sq"], tiers  # states on NVMe
    groups = after_reports[-1]["groups"]
    assert all(r["overlap_groups"] == 0 and r["redone_groups"] == 0 for r in after_reports)
    # Every group but the embeddings' begins in backward; the step updates that one, whose gradients backward
    # makes final last (in its last moment: nothing of backward is left to hide its update behind).
    begun = groups - 1
    if clip == 0.0:  # every update begun stands
        assert [(r["overlap_groups"], r["redone_groups"]) for r in reports] == [(begun, 0)] * len(reports), reports
    else:  # every step clips: each group begun in backward is put back and updated again
        assert [(r["overlap_groups"], r["redone_groups"]) for r in reports] == [(0, begun)] * len(reports), reports


def test_with_accumulation_only_the_last_backward_begins_updates(tmp_path):
    (tmp_path / "after").mkdir()
    (tmp_path / "overlapped").mkdir()
    after, _, _ = gpt_run(tmp_path / "after", False, steps=3, accumulation=2)
    overlapped, reports, _ = gpt_run(tmp_path / "overlapped", True, steps=3, accumulation=2)
    assert_same(after, overlapped)
    assert all(r["overlap_groups"] > 0 for r in reports), reports


def test_a_schedule_that_changes_the_lr_every_step_lets_the_updates_stand(tmp_path):
    (tmp_path / "after").mkdir()
    (tmp_path / "overlapped").mkdir()
    after, _, _ = gpt_run(tmp_path / "after", False, schedule=True)
    overlapped, reports, _ = gpt_run(tmp_path / "overlapped", True, schedule=True)
    assert_same(after, overlapped)
    assert all(r["redone_groups"] == 0 and r["overlap_groups"] > 0 for r in reports), reports


def test_a_second_backward_before_the_step_and_an_evaluation_after_it_change_nothing(tmp_path):
    (tmp_path / "after").mkdir()
    (tmp_path / "overlapped").mkdir()
    after, _, _ = gpt_run(tmp_path / "after", False, steps=3, backwards=2, evaluate=True)
    overlapped, reports, _ = gpt_run(tmp_path / "overlapped", True, steps=3, backwards=2, evaluate=True)
    assert_same(after, overlapped)
    # The second forward put the groups the first backward updated back; the second backward began them again.
    assert all(r["overlap_groups"] > 0 and r["redone_groups"] == 0 for r in reports), reports


class Scale(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x):
        return x * self.w


class Overflow(torch.autograd.Function):
    """Identity whose backward makes the gradient infinite: an overflow in the first layer's alone."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class Scales(torch.nn.Module):
    """Elementwise layers of one chunk each; with `reentrant`, the first layer runs in two reentrant checkpoints,
    so that autograd accumulates its gradient twice, the second time after its group's update began. With
    `overflow` set, the first layer's gradients overflow: backward reaches it last, after the others' updates
    began."""

    def __init__(self, layers=4, n=2048, reentrant=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(Scale(n) for _ in range(layers))
        self.reentrant = reentrant
        self.overflow = False

    def forward(self, x, t):
        if self.reentrant:
            first = self.layers[0]
            x = torch.utils.checkpoint.checkpoint(first, x, use_reentrant=True)
            x = torch.utils.checkpoint.checkpoint(first, x, use_reentrant=True)
        else:
            x = self.layers[0](x)
        if self.overflow:
            x = Overflow.apply(x)
        for layer in self.layers[1:]:
            x = layer(x)
        return ((x - t) ** 2).float().mean()


def scales_run(tmp_path, overlap, precision="fp32", reentrant=False, steps=6, overflow_at=(), **config):
    torch.manual_seed(0)
    model = Scales(reentrant=reentrant)
    engine = strata.initialize(model, three_tiers(tmp_path, precision=precision,
                                                  optimizer={"type": "adamw", "lr": 0.05, "weight_decay": 0.01,
                                                             "overlap": "64MiB" if overlap else 0},
                                                  **config))
    target = torch.randn(2048)
    reports = []
    for step in range(steps):
        model.overflow = step in overflow_at
        x = torch.randn(2048, requires_grad=reentrant)  # a reentrant checkpoint needs an input that requires grad
        engine.backward(engine(x.to(engine.dtype), (x * target).to(engine.dtype)))
        engine.step()
        reports.append(engine.last_step)
    state = {**engine.state_dict(master=precision != "fp32"), **optimizer_states(engine)}
    engine.close()
    return state, reports


def test_an_fp16_overflow_skips_the_same_steps_and_leaves_the_same_states(tmp_path):
    (tmp_path / "after").mkdir()
    (tmp_path / "overlapped").mkdir()
    scaling = {"loss_scale": {"init": 1024.0, "growth_interval": 2}}
    after, after_reports = scales_run(tmp_path / "after", False, precision="fp16", overflow_at=(2, 5), **scaling)
    overlapped, reports = scales_run(tmp_path / "overlapped", True, precision="fp16", overflow_at=(2, 5), **scaling)
    skipped = [r["skipped"] for r in reports]
    assert skipped == [r["skipped"] for r in after_reports] == [s in (2, 5) for s in range(6)]
    assert [r["loss_scale"] for r in reports] == [r["loss_scale"] for r in after_reports]
    assert_same(after, overlapped)
    # The other three groups' updates began before the first layer's gradients overflowed: each was put back.
    # The first layer's group, which backward reaches last, the step updates (or skips) itself.
    assert [(r["overlap_groups"], r["redone_groups"]) for r in reports] == [(0, 3) if s else (3, 0) for s in skipped]


def test_a_gradient_after_its_groups_update_began_redoes_that_group(tmp_path):
    (tmp_path / "after").mkdir()
    (tmp_path / "overlapped").mkdir()
    after, _ = scales_run(tmp_path / "after", False, reentrant=True)
    overlapped, reports = scales_run(tmp_path / "overlapped", True, reentrant=True)
    assert_same(after, overlapped)
    assert all(r["redone_groups"] == 1 and r["overlap_groups"] == 3 for r in reports), reports


def test_a_hugging_face_llama_trains_the_same_with_overlap(tmp_path):
    transformers = pytest.importorskip("transformers")

    def run(directory, overlap):
        directory.mkdir()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa"))
        engine = strata.initialize(model, three_tiers(directory, optimizer={"overlap": "64MiB" if overlap else 0},
                                                      gradient_clipping=1.0))
        reports = []
        for tokens in batches(4, vocab=96):
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()
            reports.append(engine.last_step)
        state = {**engine.state_dict(), **optimizer_states(engine)}
        engine.close()
        return state, reports

    after, _ = run(tmp_path / "after", False)
    overlapped, reports = run(tmp_path / "overlapped", True)
    assert_same(after, overlapped)
    assert all(r["overlap_groups"] + r["redone_groups"] > 0 for r in reports), reports


def test_a_bad_size_is_refused_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match="optimizer.overlap"):
        strata.initialize(Scales(), three_tiers(tmp_path, optimizer={"overlap": "lots"}))


def test_the_size_reaches_the_updates_exactly(tmp_path):
    """123456789 bytes, which describe() writes as 117.7MiB: the updates get the bytes given, not that."""
    engine = strata.initialize(Scales(), three_tiers(tmp_path, optimizer={"overlap": 123456789}))
    assert engine._overlap.updates.kept_bytes == 123456789
