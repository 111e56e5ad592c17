"""stepkernels.gpt and stepkernels.train: the GPT on our kernels against the same parameters on
PyTorch's layers, dropout seeds on the device, training, checkpoints and sampling."""

import dataclasses
from pathlib import Path

import pytest
from stepkernels.models.data import CharacterData
from stepkernels.models.gpt import GPT, ConfigError, ConfigTypeError, GPTConfig
from stepkernels.models.train import Config, Trainer, learning_rate, parse_config
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch

TEXT = "to be, or not to be: that is the question. whether 'tis nobler in the mind\n" * 40
CHARS = "".join(sorted(set(TEXT)))


def tiny_data() -> CharacterData:
    ids = torch.tensor([CHARS.index(c) for c in TEXT], dtype=torch.uint8)
    split = len(ids) * 9 // 10
    return CharacterData(ids[:split], ids[split:], CHARS, Path("."))


def tiny_model(dropout=0.0, n_layer=1, seed=0, **changes):
    torch.manual_seed(seed)
    config = GPTConfig(len(CHARS), block_size=8, n_layer=n_layer, n_head=2, n_embd=16, dropout=dropout, **changes)
    return GPT(config).to(DEVICE)


def tiny_config(**changes) -> Config:
    settings = dict(
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=8,
        batch_size=2,
        dropout=0.0,
        max_steps=3,
        learning_rate=1e-2,
        warmup_steps=1,
        eval_interval=0,
        eval_batches=1,
        log_interval=1,
        checkpoint=False,
        sample_tokens=0,
        step="eager",
        dtype="float32",
        out_dir="",
    )
    return Config(**{**settings, **changes})


def tokens(batch=2, time=8, seed=1):
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(CHARS), (batch, time + 1), generator=generator).to(DEVICE)
    return idx[:, :-1], idx[:, 1:]


def forward_backward(model, idx, targets):
    model.zero_grad()
    logits, loss = model(idx, targets)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("n_layer", [1, 2])
def test_triton_and_torch_layers_agree_at_initialization(n_layer):
    model = tiny_model(n_layer=n_layer)
    idx, targets = tokens()
    ours = forward_backward(model, idx, targets)
    model.use_triton = False
    theirs = forward_backward(model, idx, targets)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    for name, grad in ours[2].items():
        torch.testing.assert_close(grad, theirs[2][name], rtol=1e-3, atol=1e-5, msg=name)


def test_short_sequences_and_no_targets():
    model = tiny_model()
    idx, _ = tokens(batch=3, time=5)
    logits, loss = model(idx)
    assert loss is None and logits.shape == (3, 5, len(CHARS))
    model.use_triton = False
    torch.testing.assert_close(model(idx)[0], logits, rtol=1e-4, atol=1e-5)


def test_one_state_dict_serves_both():
    ours, theirs = tiny_model(seed=0), tiny_model(seed=1, use_triton=False)
    assert not theirs.use_triton
    theirs.load_state_dict(ours.state_dict())
    idx, targets = tokens()
    torch.testing.assert_close(ours(idx, targets)[1], theirs(idx, targets)[1])


def test_dropout_draws_new_masks_each_step_and_none_in_eval():
    model = tiny_model(dropout=0.3)
    idx, targets = tokens()
    seeds = model.seeds.clone()
    first, second = model(idx)[0], model(idx)[0]
    assert not torch.equal(first, second)
    assert torch.equal(model.seeds, seeds + 2 * len(seeds))  # one advance per forward
    model(idx, targets)[1].backward()  # the backward regenerates the masks
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    evaluated = model(idx)[0]
    without = tiny_model(dropout=0.0)
    without.load_state_dict(model.state_dict())
    torch.testing.assert_close(evaluated, without(idx)[0], rtol=0, atol=0)


def test_refuses_bad_input():
    model = tiny_model()
    idx, targets = tokens(time=8)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.cat([idx, idx], dim=1))
    with pytest.raises(TypeError, match="token ids"):
        model(idx.float())
    with pytest.raises(ValueError, match="targets"):
        model(idx, targets[:, :4])
    with pytest.raises(TypeError, match="GPT takes one GPTConfig"):
        GPT(10)  # a vocabulary size alone: the config holds it
    for bad_targets in (targets.tolist(), targets.to(torch.uint8)):
        with pytest.raises(TypeError, match="targets must be a tensor of token ids"):
            model(idx, bad_targets)
    bad_sampling = ({"top_k": 0}, {"temperature": 0}, {"temperature": float("inf")})
    for prompt, options in ((idx[:, :0], {}), (idx[0], {}), *((idx, bad) for bad in bad_sampling)):
        with pytest.raises(ValueError, match="time|temperature|top_k"):
            model.generate(prompt, 2, **options)
    with pytest.raises(ValueError, match=r"time, got shape \(8,\): one sequence is idx\[None\]"):
        model.generate(idx[0], 2)  # no block_size in the message: a prompt may be longer


@pytest.mark.parametrize(
    "fields, field, error, message",
    [
        (dict(n_head=3, n_embd=16), "n_embd", ValueError, r"n_embd \(16\) must be a multiple of n_head \(3\)"),
        (dict(n_head=0), "n_head", ValueError, "n_head must be at least 1, got 0"),
        (dict(n_layer=2.0), "n_layer", TypeError, "n_layer must be an int, got 2.0"),
        (dict(n_head=2, n_embd=512), "n_head", ValueError, "at most 128; use n_head >= 4"),
        (dict(dropout=1.5), "dropout", ValueError, r"dropout must be in \[0, 1\), got 1.5"),
        (dict(bias="no"), "bias", TypeError, "bias must be True or False"),
        (dict(vocab_size=0), "vocab_size", ValueError, "vocab_size must be at least 1"),
    ],
)
def test_config_refuses_a_shape_before_any_parameter(fields, field, error, message):
    """Values out of range are ValueErrors, values of the wrong type TypeErrors; both name
    their field (the training CLI names the option)."""
    with pytest.raises((ConfigError, ConfigTypeError), match=message) as refused:
        GPTConfig(**{"vocab_size": 10, **fields})
    assert refused.value.field == field and type(refused.value).__mro__[1] is error


def test_modules_are_named_after_the_maths_and_bias_false_drops_every_bias():
    names = set(tiny_model().state_dict())
    for name in (
        "tokens.weight",
        "positions.weight",
        "norm.weight",
        "blocks.0.norm_1.bias",
        "blocks.0.attention.qkv.weight",
        "blocks.0.attention.out.bias",
        "blocks.0.mlp.fc.weight",
        "blocks.0.mlp.out.weight",
        "blocks.0.norm_2.weight",
    ):
        assert name in names, name
    model = tiny_model(bias=False)
    assert not [name for name in model.state_dict() if name.endswith("bias")]
    idx, targets = tokens()
    ours = forward_backward(model, idx, targets)
    model.use_triton = False
    theirs = forward_backward(model, idx, targets)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    for name, grad in ours[2].items():
        torch.testing.assert_close(grad, theirs[2][name], rtol=1e-3, atol=1e-5, msg=name)


def test_int32_targets_give_one_loss_on_both_layers():
    model = tiny_model()
    idx, targets = tokens(time=8)
    losses = []
    for use_triton in (True, False):
        model.use_triton = use_triton
        losses.append(model(idx, targets.int())[1])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[1], model(idx, targets)[1], rtol=0, atol=0)


def test_generate_extends_and_repeats_with_a_generator():
    model = tiny_model()
    idx, _ = tokens(batch=1, time=3)
    outs = [model.generate(idx, 10, generator=torch.Generator(DEVICE).manual_seed(0)) for _ in range(2)]
    assert outs[0].shape == (1, 13) and torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][:, :3], idx)


def test_learning_rate_warms_up_then_decays():
    cfg = Config(max_steps=100, warmup_steps=10, learning_rate=1.0, min_lr=0.1)
    rates = [learning_rate(step, cfg) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:], strict=False))
    assert rates[-1] == pytest.approx(0.1, abs=1e-3)


def test_training_learns_and_matches_torch_each_step():
    """The issue's check under the interpreter: the loss falls, and each step's loss equals
    the PyTorch path's within 1e-4 in fp32."""
    losses = {}
    for use_triton in (True, False):
        trainer = Trainer(tiny_config(use_triton=use_triton, max_steps=4), tiny_data())
        trainer.train(log=lambda line: None)
        losses[use_triton] = [loss for _, loss in trainer.losses]
    assert losses[True][-1] < losses[True][0] - 0.05
    assert losses[True] == pytest.approx(losses[False], abs=1e-4)


def test_resume_continues_the_same_run(tmp_path):
    data = tiny_data()
    whole = Trainer(tiny_config(max_steps=4), data)
    whole.train(log=lambda line: None)
    first = Trainer(tiny_config(max_steps=2, out_dir=str(tmp_path), checkpoint=True), data)
    first.train(log=lambda line: None)
    resumed = Trainer(tiny_config(max_steps=4, out_dir=str(tmp_path), resume=True), data)
    lines = []
    resumed.train(log=lines.append)
    assert "resuming with a change: saved with max_steps 2, this run has 4" in lines
    assert any(line.startswith("resumed from") for line in lines) and resumed.step == 4
    resumed_state = resumed.model.state_dict()
    for name, value in whole.model.state_dict().items():
        torch.testing.assert_close(value, resumed_state[name], rtol=1e-5, atol=1e-6, msg=name)


def test_summary_and_sample():
    summary = Trainer(tiny_config(max_steps=2, sample_tokens=5, prompt="to"), tiny_data()).train(log=lambda line: None)
    assert summary["sample"].startswith("to") and len(summary["sample"]) == 7
    assert [h["step"] for h in summary["history"]] == [2]
    assert set(summary["history"][0]) == {"step", "tokens", "train_loss", "val_loss", "seconds"}


def test_command_line_options_are_the_config():
    cfg = parse_config(["--n-layer", "2", "--no-use-triton", "--learning-rate", "3e-4"])
    assert (cfg.n_layer, cfg.use_triton, cfg.learning_rate) == (2, False, 3e-4)
    with pytest.raises(ConfigError, match="expected one of eager, graph, compile, max-autotune, got 'fast'"):
        Trainer(tiny_config(step="fast"), tiny_data())


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and bf16 autocast: on the GPU")
def test_graph_step_matches_eager_step_on_the_gpu():
    data = tiny_data()
    runs = {}
    for step in ("eager", "graph"):
        cfg = tiny_config(step=step, max_steps=8, dtype="bfloat16", n_embd=64, n_head=2)
        trainer = Trainer(cfg, data)
        trainer.train(log=lambda line: None)
        runs[step] = [loss for _, loss in trainer.losses]
    assert runs["graph"] == pytest.approx(runs["eager"], abs=2e-2)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: on the GPU")
def test_graph_replays_draw_new_dropout_masks():
    trainer = Trainer(tiny_config(step="graph", max_steps=6, dropout=0.5), tiny_data())
    trainer.train(log=lambda line: None)
    seeds = trainer.model.seeds.clone()
    trainer.run_step()
    assert torch.equal(trainer.model.seeds, seeds + len(seeds))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: on the GPU")
def test_graph_replay_fills_no_counters():
    """The split products' counters and the fused dropout's sums (core.zeroed) are made on
    the warm-up steps' stream and left at zero; the graph, recorded on that stream, finds
    them there. Recorded on a stream of its own, each launch recorded an int32 fill."""
    cfg = tiny_config(step="graph", max_steps=5, dropout=0.5, dtype="bfloat16", n_embd=64)
    trainer = Trainer(cfg, tiny_data())
    trainer.train(log=lambda line: None)
    assert trainer.graph is not None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        trainer.run_step()
        torch.cuda.synchronize()
    names = [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert any("dropout" in name for name in names), names  # the replay was seen
    fills = [name for name in names if "FillFunctor<int>" in name]
    assert fills == [], fills


@pytest.mark.skipif(not ON_GPU, reason="fp32 without tf32: on the GPU")
@pytest.mark.parametrize("size", ["small", "chapter 12's full model"])
def test_layers_agree_in_fp32_on_the_gpu(size):
    # The full model (Config's defaults) is what chapter 12 checks under STEPKERNELS_FULL=1;
    # its quick run checks the tiny preset.
    full = size != "small"
    shape = Config().model_config(len(CHARS)) if full else None
    shape = shape or GPTConfig(len(CHARS), block_size=64, n_layer=2, n_head=2, n_embd=128)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(shape, dropout=0.0)).to(DEVICE)
        idx, targets = tokens(batch=4, time=shape.block_size)
        ours = forward_backward(model, idx, targets)
        model.use_triton = False
        theirs = forward_backward(model, idx, targets)
    finally:
        torch.set_float32_matmul_precision(previous)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    for name, grad in ours[2].items():
        torch.testing.assert_close(grad, theirs[2][name], rtol=1e-3, atol=1e-5, msg=name)
