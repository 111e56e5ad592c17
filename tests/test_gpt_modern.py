"""The GPT's modern block (issue 43): RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention and no biases, chosen by GPTConfig's fields. Our layers against PyTorch's over one
state dict in fp32, for the modern block and blocks that mix old and new; training, errors,
checkpoints and the preset. GPU-only tests run the preset's size."""

import dataclasses

import pytest
from stepkernels.models import config, train
from stepkernels.models.gpt import (
    GPT,
    ConfigError,
    ConfigTypeError,
    GPTConfig,
    TorchLayers,
    TritonLayers,
    flops_per_token,
)
from stepkernels.models.train import Trainer
from stepkernels.runtime.core import DEVICE, ON_GPU
from test_gpt import CHARS, forward_backward, tiny_config, tiny_data, tokens
import torch
import torch.nn.functional as F

MODERN = dict(norm="rms", position="rotary", mlp="swiglu", n_kv_head=1, bias=False)
# Blocks that mix GPT-2's layers with the new ones: each choice alone, and together.
MIXED = {
    "modern": MODERN,
    "rms norm, biases in the linear layers": dict(norm="rms"),
    "rotary with grouped heads": dict(position="rotary", n_kv_head=2, n_head=4),
    "swiglu of a chosen width": dict(mlp="swiglu", mlp_hidden=24),
}


def model_of(seed=0, n_layer=1, n_head=2, n_embd=16, block_size=8, **choices):
    torch.manual_seed(seed)
    shape = dict(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    return GPT(GPTConfig(len(CHARS), **shape, **choices)).to(DEVICE)


def assert_layers_agree(model, idx, targets):
    """Logits, loss and every parameter's gradient: ours against PyTorch's, in fp32."""
    model.use_triton = True
    ours = forward_backward(model, idx, targets)
    model.use_triton = False
    theirs = forward_backward(model, idx, targets)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-4, atol=1e-4)  # as chapter 12
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    assert ours[2].keys() == theirs[2].keys()
    for name, grad in ours[2].items():
        assert grad is not None and grad.abs().sum() > 0, name  # every parameter learns
        torch.testing.assert_close(grad, theirs[2][name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("choices", MIXED.values(), ids=MIXED.keys())
def test_triton_and_torch_layers_agree_in_fp32(choices):
    model = model_of(**{"n_layer": 2, **choices} if choices is MODERN else choices)
    assert_layers_agree(model, *tokens())


def test_chapter_14s_check_reports_and_fails_where_the_layers_differ(monkeypatch):
    from stepkernels.lessons.training import compare_layers

    model = model_of(**MODERN)
    idx, targets = tokens()
    assert compare_layers(model, idx, targets).startswith("loss ")
    # PyTorch's side without the rotation: the check must see it
    monkeypatch.setattr(TorchLayers, "rotary", lambda self, q, k, cos, sin: (q, k))
    with pytest.raises(AssertionError):
        compare_layers(model, idx, targets)
    assert model.use_triton  # as it was


def test_the_modern_block_changes_what_it_says():
    """Each choice changes the model: rotary positions turn q and k (logits move where the
    angle is not 0, at every position but the first), and grouped heads share k and v
    (our copies as SDPA's enable_gqa)."""
    model = model_of(**MODERN)
    idx, _ = tokens()
    turned = model(idx)[0]
    model.cos.fill_(1.0), model.sin.zero_()  # every angle 0: no rotation
    unturned = model(idx)[0]
    torch.testing.assert_close(turned[:, 0], unturned[:, 0])
    assert not torch.allclose(turned[:, 1:], unturned[:, 1:], atol=1e-6)
    q = torch.randn(2, 4, 5, 8, device=DEVICE)
    k, v = torch.randn(2, 2, 5, 8, device=DEVICE), torch.randn(2, 2, 5, 8, device=DEVICE)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(TorchLayers().attention(q, k, v), grouped)
    # ours: the grouped k and v heads as they are, each read by its group's query heads
    torch.testing.assert_close(TritonLayers().attention(q, k, v), grouped, rtol=1e-5, atol=1e-5)


def test_defaults_keep_gpt2s_block_and_its_state_dict():
    """Existing checkpoints load: the default config's parameters are GPT-2's, by name and
    shape; the modern block's have no biases, no position embedding, a narrower qkv."""
    classic = {name: tuple(t.shape) for name, t in model_of().state_dict().items()}
    assert classic == {
        "tokens.weight": (len(CHARS), 16),
        "positions.weight": (8, 16),
        "blocks.0.norm_1.weight": (16,),
        "blocks.0.norm_1.bias": (16,),
        "blocks.0.attention.qkv.weight": (48, 16),
        "blocks.0.attention.qkv.bias": (48,),
        "blocks.0.attention.out.weight": (16, 16),
        "blocks.0.attention.out.bias": (16,),
        "blocks.0.norm_2.weight": (16,),
        "blocks.0.norm_2.bias": (16,),
        "blocks.0.mlp.fc.weight": (64, 16),
        "blocks.0.mlp.fc.bias": (64,),
        "blocks.0.mlp.out.weight": (16, 64),
        "blocks.0.mlp.out.bias": (16,),
        "norm.weight": (16,),
        "norm.bias": (16,),
    }
    modern = {name: tuple(t.shape) for name, t in model_of(**MODERN).state_dict().items()}
    assert modern == {
        "tokens.weight": (len(CHARS), 16),
        "blocks.0.norm_1.weight": (16,),
        "blocks.0.attention.qkv.weight": ((2 + 2 * 1) * 8, 16),  # H + 2 H_kv heads of 8
        "blocks.0.attention.out.weight": (16, 16),
        "blocks.0.norm_2.weight": (16,),
        "blocks.0.mlp.fc.weight": (2 * 64, 16),  # gate and up: 8 x 16 / 3 -> 64
        "blocks.0.mlp.out.weight": (16, 64),
        "norm.weight": (16,),
    }


@pytest.mark.parametrize("choices", [{}, MODERN, dict(mlp="swiglu", n_kv_head=1)])
def test_flops_count_every_product_weight(choices):
    """flops_per_token's weights are the model's matrices that multiply (not the position
    embedding, a lookup): 6 FLOPs a weight a token, plus attention's."""
    model = model_of(**choices)
    cfg = model.config
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
    weights -= 0 if cfg.position == "rotary" else model.positions.weight.numel()
    attention = cfg.n_layer * 3.5 * 2 * cfg.block_size * cfg.n_embd
    assert flops_per_token(cfg) == 6 * weights + attention


def test_a_run_says_which_block_it_trains():
    lines = Trainer(tiny_config(**MODERN), tiny_data()).describe()
    wanted = "block: RMSNorm, rotary positions, SwiGLU MLP 64 wide, 1 head of k and v for 2 of q, no biases"
    assert wanted in lines
    lines = Trainer(tiny_config(), tiny_data()).describe()
    assert "block: layer norm, learned positions, GELU MLP 64 wide, 2 heads of k and v for 2 of q, biases" in lines


def test_swiglu_width_follows_llama_unless_chosen():
    assert GPTConfig(10, n_embd=384, n_head=6, mlp="swiglu").hidden == 1024  # 8C/3
    assert GPTConfig(10, n_embd=32, n_head=2, mlp="swiglu").hidden == 128  # 85 -> 128
    assert GPTConfig(10, n_embd=384, n_head=6).hidden == 4 * 384
    assert GPTConfig(10, n_embd=32, n_head=2, mlp="swiglu", mlp_hidden=40).hidden == 40
    assert GPTConfig(10, n_head=6, n_kv_head=0).kv_heads == 6


@pytest.mark.parametrize(
    "fields, field, error, message",
    [
        (dict(n_head=6, n_kv_head=4), "n_kv_head", ValueError, r"multiple of n_kv_head \(4\).*one of 1, 2, 3, 6"),
        (dict(n_head=2, n_embd=16, n_kv_head=3), "n_kv_head", ValueError, r"n_head \(2\) must be a multiple"),
        (dict(n_head=2, n_kv_head=-1), "n_kv_head", ValueError, "n_kv_head must be at least 0, got -1"),
        (dict(n_kv_head=1.0), "n_kv_head", TypeError, "n_kv_head must be an int, got 1.0"),
        (dict(mlp_hidden=-4), "mlp_hidden", ValueError, "mlp_hidden must be at least 0"),
        (dict(n_head=2, n_embd=6, position="rotary"), "position", ValueError, "= 3 values, an odd number"),
        (dict(norm="layernorm"), "norm", ValueError, "norm must be one of layer, rms, got 'layernorm'"),
        (dict(position="alibi"), "position", ValueError, "position must be one of learned, rotary"),
        (dict(mlp="geglu"), "mlp", ValueError, "mlp must be one of gelu, swiglu"),
    ],
)
def test_config_refuses_a_bad_block(fields, field, error, message):
    with pytest.raises((ConfigError, ConfigTypeError), match=message) as refused:
        GPTConfig(**{"vocab_size": 10, **fields})
    assert refused.value.field == field and type(refused.value).__mro__[1] is error


def test_the_command_line_takes_the_block_and_refuses_a_bad_one(capsys):
    block = ["--norm", "rms", "--position", "rotary", "--mlp", "swiglu", "--n-kv-head", "1", "--no-bias"]
    cfg = train.parse_config(["--config", "tiny", *block])
    assert (cfg.norm, cfg.position, cfg.mlp, cfg.n_kv_head, cfg.bias) == ("rms", "rotary", "swiglu", 1, False)
    with pytest.raises(SystemExit) as stop:
        train.parse_config(["--config", "tiny", "--n-kv-head", "3"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "argument --n-kv-head: n_head (2) must be a multiple of n_kv_head (3)" in err
    with pytest.raises(SystemExit):
        train.parse_config(["--norm", "batch"])
    assert "argument --norm: invalid choice: 'batch'" in capsys.readouterr().err


def test_the_preset_is_shakespeares_model_with_the_modern_block():
    modern, classic = config.preset("modern-shakespeare"), config.preset("shakespeare")
    assert "modern-shakespeare" in config.preset_names()
    config.check_config(modern)
    block = dict(norm="rms", position="rotary", mlp="swiglu", n_kv_head=2, bias=False)
    assert {name: getattr(modern, name) for name in block} == block
    same = {f.name for f in dataclasses.fields(config.Config)} - {*block, "out_dir"}
    assert {n: getattr(modern, n) for n in same} == {n: getattr(classic, n) for n in same}
    shape = modern.model_config(84)
    assert (shape.n_layer, shape.n_head, shape.n_embd, shape.block_size) == (6, 6, 384, 256)
    assert (shape.kv_heads, shape.hidden) == (2, 1024)
    assert train.parse_config(["--config", "modern-shakespeare"]) == modern  # by its name


def test_the_modern_model_trains_and_matches_torch_each_step():
    """A few fp32 steps under the interpreter: the loss falls, each step's loss equals the
    PyTorch path's within 1e-4."""
    losses = {}
    for use_triton in (True, False):
        cfg = tiny_config(**MODERN, use_triton=use_triton, max_steps=4)
        trainer = Trainer(cfg, tiny_data())
        trainer.train(log=lambda line: None)
        losses[use_triton] = [loss for _, loss in trainer.losses]
    assert losses[True][-1] < losses[True][0] - 0.05
    assert losses[True] == pytest.approx(losses[False], abs=1e-4)


def test_a_modern_checkpoint_resumes_and_refuses_another_block(tmp_path):
    data = tiny_data()
    first = Trainer(tiny_config(**MODERN, max_steps=1, out_dir=str(tmp_path), checkpoint=True, use_triton=False), data)
    first.train(log=lambda line: None)
    resumed = Trainer(tiny_config(**MODERN, max_steps=2, out_dir=str(tmp_path), resume=True, use_triton=False), data)
    resumed.train(log=lambda line: None)
    assert resumed.step == 2 and "positions.weight" not in resumed.model.state_dict()
    state = train.read_checkpoint(tmp_path / train.CHECKPOINT)
    for name, value in MODERN.items():
        other = {"norm": "layer", "position": "learned", "mlp": "gelu", "n_kv_head": 2, "bias": True}[name]
        cfg = tiny_config(**{**MODERN, name: other}, max_steps=3, resume=True)
        with pytest.raises(ConfigError, match=f"saved with {name} {value}, this run has {other}"):
            train.check_resume(cfg, state, data.chars)


def test_a_checkpoint_from_before_the_block_choices_resumes_as_gpt2s(tmp_path):
    """A checkpoint written before these fields existed holds none of them in its config:
    it resumes with the defaults, GPT-2's block."""
    data = tiny_data()
    settings = dict(out_dir=str(tmp_path), use_triton=False)  # PyTorch's layers: quicker
    Trainer(tiny_config(max_steps=1, checkpoint=True, **settings), data).train(log=lambda line: None)
    path = tmp_path / train.CHECKPOINT
    state = train.read_checkpoint(path)
    for name in ("norm", "position", "mlp", "n_kv_head", "mlp_hidden"):
        del state["config"][name]
    torch.save(state, path)
    notes = train.check_resume(tiny_config(max_steps=2, resume=True, **settings), state, data.chars)
    assert notes == ["resuming with a change: saved with max_steps 1, this run has 2"]
    with pytest.raises(ConfigError, match="saved with norm layer, this run has rms"):
        train.check_resume(tiny_config(max_steps=2, resume=True, norm="rms", **settings), state, data.chars)
    resumed = Trainer(tiny_config(max_steps=2, resume=True, **settings), data)
    resumed.train(log=lambda line: None)
    assert resumed.step == 2


def test_generate_with_rotary_positions():
    model = model_of(**MODERN)
    idx, _ = tokens(batch=1, time=3)
    out = model.generate(idx, 3, generator=torch.Generator(DEVICE).manual_seed(0))
    assert out.shape == (1, 6) and torch.equal(out[:, :3], idx)


def test_the_modern_model_traces_whole_on_our_kernels():
    """torch.compile sees one graph: RMSNorm, the rotation, SwiGLU's product and the
    grouped heads' copies all trace without a break (as chapter 12's GPT, test_compile)."""
    model = model_of(**{**MODERN, "dropout": 0.1})
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*tokens())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# ------------------------------------------------------------------------- on a GPU
def preset_shape(**changes) -> GPTConfig:
    return dataclasses.replace(config.preset("modern-shakespeare").model_config(len(CHARS)), dropout=0.0, **changes)


@pytest.mark.skipif(not ON_GPU, reason="fp32 without tf32 at the preset's size: on the GPU")
@pytest.mark.parametrize(
    "choices",
    [{}, dict(n_kv_head=6), dict(norm="layer", bias=True)],
    ids=["preset", "no grouped heads", "layer norm and biases"],
)
def test_layers_agree_in_fp32_at_the_presets_size_on_the_gpu(choices):
    shape = preset_shape(**choices)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        torch.manual_seed(0)
        assert_layers_agree(GPT(shape).to(DEVICE), *tokens(batch=4, time=shape.block_size))
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and bf16 autocast: on the GPU")
def test_the_modern_graph_step_matches_eager_in_bf16_on_the_gpu():
    data = tiny_data()
    runs = {}
    for step in ("eager", "graph"):
        cfg = tiny_config(**{**MODERN, "n_kv_head": 2}, step=step, max_steps=8, dtype="bfloat16", n_embd=128, n_head=4)
        trainer = Trainer(cfg, data)
        trainer.train(log=lambda line: None)
        runs[step] = [loss for _, loss in trainer.losses]
    assert runs["graph"] == pytest.approx(runs["eager"], abs=2e-2)


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of our kernels: on the GPU")
@pytest.mark.parametrize("use_triton", [True, False])
def test_the_modern_model_compiles_without_a_graph_break_on_the_gpu(use_triton):
    torch.manual_seed(0)
    model = GPT(preset_shape(n_layer=2, use_triton=use_triton)).to(DEVICE)
    idx, targets = tokens(batch=2, time=model.config.block_size)
    eager = model(idx, targets)[1]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)(idx, targets)[1]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
