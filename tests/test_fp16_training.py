"""fp16 training (issue 42): FusedAdamW under torch.amp.GradScaler against PyTorch's AdamW step
by step, overflows included; the default dtype on a GPU without bf16; ``--dtype float16`` in the
training command, on PyTorch's layers and on ours with FusedAdamW, as a GPU runs it (on the CPU
under the interpreter); on a GPU, the scaler inside the whole-step CUDA graph."""

import dataclasses
import itertools
import math
import statistics

from conftest import random_tensor
import pytest
import small_text
from stepkernels import FusedAdamW
from stepkernels.models import config, sample, train
from stepkernels.models import data as datasets
from stepkernels.models.gpt import ConfigError
from stepkernels.runtime.core import DEVICE, ON_GPU
from stepkernels.runtime.device import PROFILES
import torch

SHAPES = [(7, 5), (5,), (1,), (3, 2, 9), (130,), (33, 65)]
INF_STEP, NAN_STEP, STEPS = 2, 5, 7  # steps whose gradients overflow, of 7


def groups(params):
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_optimizer(kind, params):
    lr, betas = 3e-3, (0.9, 0.99)
    rate = torch.tensor(lr, device=DEVICE)
    if kind == "ours":
        return FusedAdamW(groups(params), lr=rate, betas=betas)
    if kind == "torch fused":  # takes grad_scale and found_inf, as ours does
        return torch.optim.AdamW(groups(params), lr=rate, betas=betas, fused=True, capturable=True)
    return torch.optim.AdamW(groups(params), lr=lr, betas=betas)  # the scaler reads found_inf on the host


def scaled_step(params, optimizer, scaler, step, clip):
    """The training command's step: the scaled loss's backward, the gradients unscaled and
    clipped (clip > 0), the step skipped on an overflow, the scale updated."""
    sources = [random_tensor(p.shape, seed=100 * step + i, scale=0.5) for i, p in enumerate(params)]
    if step == INF_STEP:
        sources[0].view(-1)[3] = math.inf
    if step == NAN_STEP:
        sources[-1].view(-1)[-1] = math.nan
    optimizer.zero_grad(set_to_none=True)
    loss = sum((p * s).sum() for p, s in zip(params, sources, strict=True))
    scaler.scale(loss).backward()
    if clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, clip)
    scaler.step(optimizer)
    scaler.update()


def step_count(optimizer, p):
    return float(optimizer.state[p]["step"])


@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["unscaled in the kernel", "unscale_ and clipping"])
@pytest.mark.parametrize("reference", ["torch", "torch fused"])
def test_fused_adamw_under_a_grad_scaler_matches_torch(reference, clip):
    start = [random_tensor(s, seed=i) for i, s in enumerate(SHAPES)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    opt_ours, opt_theirs = make_optimizer("ours", ours), make_optimizer(reference, theirs)
    # growth every 2 good steps: the scale doubles and halves within the run
    options = dict(init_scale=2.0**10, growth_interval=2)
    scalers = [torch.amp.GradScaler(DEVICE.type, **options) for _ in range(2)]
    scales, counts = [], []
    for step in range(STEPS):
        before = [p.detach().clone() for p in ours]
        scale = scalers[0].get_scale()
        scaled_step(ours, opt_ours, scalers[0], step, clip)
        scaled_step(theirs, opt_theirs, scalers[1], step, clip)
        skipped = step in (INF_STEP, NAN_STEP)
        if skipped:  # nothing moved, the count stands, the scale halved
            assert all(torch.equal(a, b) for a, b in zip(ours, before, strict=True)), step
            assert scalers[0].get_scale() == scale / 2
        assert scalers[0].get_scale() == scalers[1].get_scale(), step
        scales.append(scalers[0].get_scale())
        counts.append(step_count(opt_ours, ours[0]))
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            where = f"step {step}, parameter {i}"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
            assert step_count(opt_ours, a) == step_count(opt_theirs, b), where
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt_ours.state[a][key], opt_theirs.state[b][key], rtol=1e-5, atol=1e-7)
            if not skipped:  # the gradients left unscaled, as PyTorch leaves them
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0.0, msg=where)
    # GradScaler's own rule, seen through our optimizer's overflow flags
    assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10]
    assert counts == [1, 2, 2, 3, 4, 4, 5]


def test_the_scaler_hands_fused_adamw_its_flag_without_a_host_read(monkeypatch):
    """GradScaler reads found_inf on the host (_maybe_opt_step) only for optimizers that cannot
    take it: ours takes it, so a CUDA graph of the step can hold the scaler."""

    def host_read(*args, **kwargs):
        raise AssertionError("GradScaler read found_inf on the host")

    monkeypatch.setattr(torch.amp.GradScaler, "_maybe_opt_step", host_read)
    params = [torch.nn.Parameter(random_tensor(s, seed=i)) for i, s in enumerate(SHAPES)]
    optimizer = make_optimizer("ours", params)
    scaler = torch.amp.GradScaler(DEVICE.type)
    for step in (0, INF_STEP):
        scaled_step(params, optimizer, scaler, step, clip=0.0)
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
    assert step_count(optimizer, params[0]) == 1  # the second step skipped


def test_fused_adamw_refuses_a_scale_that_is_not_one_float():
    params = [torch.nn.Parameter(random_tensor((4,)))]
    optimizer = FusedAdamW(params)
    params[0].grad = random_tensor((4,))
    for name, value in (
        ("found_inf", torch.zeros(2, device=DEVICE)),
        ("grad_scale", torch.ones((), device=DEVICE, dtype=torch.float64)),
    ):
        setattr(optimizer, name, value)
        with pytest.raises(TypeError, match=f"{name} must be one float32 value"):
            optimizer.step()
        delattr(optimizer, name)
    optimizer.step()


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: on the GPU")
@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["unscaled in the kernel", "unscale_ and clipping"])
def test_the_scaled_step_replays_in_a_cuda_graph(clip):
    """Backward, the scaler and our optimizer recorded as one CUDA graph and replayed with new
    sources, an inf among them at one replay and a nan at another: step by step what PyTorch's
    AdamW and its scaler do eagerly."""
    start = [random_tensor(s, seed=i) for i, s in enumerate(SHAPES)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    opt_ours, opt_theirs = make_optimizer("ours", ours), make_optimizer("torch", theirs)
    options = dict(init_scale=2.0**10, growth_interval=2)
    scalers = [torch.amp.GradScaler("cuda", **options) for _ in range(2)]
    sources = [torch.zeros_like(p) for p in ours]  # the graph reads these at every replay

    def step(params, optimizer, scaler):
        optimizer.zero_grad(set_to_none=True)
        loss = sum((p * s).sum() for p, s in zip(params, sources, strict=True))
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(optimizer)
        scaler.update()

    def new_sources(index):
        for i, (source, p) in enumerate(zip(sources, ours, strict=True)):
            source.copy_(random_tensor(p.shape, seed=100 * index + i, scale=0.5))
        if index == INF_STEP:
            sources[0].view(-1)[3] = math.inf
        if index == NAN_STEP:
            sources[-1].view(-1)[-1] = math.nan

    new_sources(0)  # an eager step first: the scaler's scale and the tables exist
    step(ours, opt_ours, scalers[0])
    step(theirs, opt_theirs, scalers[1])
    graph = torch.cuda.CUDAGraph()
    opt_ours.zero_grad(set_to_none=True)  # the graph's backward allocates them in its pool
    with torch.cuda.graph(graph):
        step(ours, opt_ours, scalers[0])
    for index in range(1, STEPS):
        new_sources(index)
        before = [p.detach().clone() for p in ours]
        graph.replay()
        step(theirs, opt_theirs, scalers[1])
        torch.cuda.synchronize()
        if index in (INF_STEP, NAN_STEP):
            assert all(torch.equal(a, b) for a, b in zip(ours, before, strict=True)), index
        assert scalers[0].get_scale() == scalers[1].get_scale(), index
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            where = f"replay {index}, parameter {i}"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
            assert step_count(opt_ours, a) == step_count(opt_theirs, b), where
    assert scalers[0].get_scale() == 2.0**10  # halved twice, doubled twice


# ------------------------------------------------------------------- the dtype's choice
T4_LIKE = dataclasses.replace(PROFILES["sm80"], name="sm75", capability=(7, 5), bf16=False)


def test_the_default_dtype_follows_bf16_in_hardware(monkeypatch):
    assert config.default_dtype(on_gpu=True, device=T4_LIKE) == "float16"
    assert config.default_dtype(on_gpu=True, device=PROFILES["sm90"]) == "bfloat16"
    assert config.default_dtype(on_gpu=False, device=T4_LIKE) == "float32"
    monkeypatch.setattr(config, "profile", lambda: T4_LIKE)  # the profile the rules read
    assert config.default_dtype(on_gpu=True) == "float16"
    note = config.dtype_note("float16", on_gpu=True, device=T4_LIKE)
    assert "no bf16" in note and "float16, the default here" in note
    assert config.dtype_note("float16", on_gpu=True, device=PROFILES["sm90"]) is None
    assert config.dtype_note("float16", on_gpu=False, device=T4_LIKE) is None


def test_bf16_on_a_gpu_without_it_suggests_float16(monkeypatch):
    monkeypatch.setattr(config.core, "ON_GPU", True)
    monkeypatch.setattr(config, "profile", lambda: T4_LIKE)
    with pytest.raises(ConfigError, match=r"no bf16 \(before Ampere\): choose float16"):
        config.check_config(config.Config(dtype="bfloat16", step="eager"))
    config.check_config(config.Config(dtype="float16", step="graph"))  # the graph holds the scaler


def test_float16_is_refused_with_fsdp_across_processes():
    cfg = config.Config(dtype="float16", parallel="fsdp", step="eager", batch_size=4)
    with pytest.raises(ConfigError, match="--parallel ddp"):
        config.check_config(cfg, world=2)
    config.check_config(cfg, world=1)
    config.check_config(dataclasses.replace(cfg, parallel="ddp"), world=2)


# ---------------------------------------------------------------------- the command
TINY = [
    *("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8"),
    *("--batch-size", "2", "--dropout", "0", "--warmup-steps", "1", "--learning-rate", "1e-2"),
    *("--eval-batches", "1", "--log-interval", "2", "--sample-tokens", "0", "--step", "eager"),
    *("--dtype", "float16"),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return small_text.prepare(tmp_path_factory.mktemp("data"))


def run_command(args, capsys):
    train.main([*TINY, *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return out


@pytest.mark.skipif(ON_GPU, reason="a CPU run: on a GPU, test_fp16_in_the_cuda_graph_on_the_gpu")
def test_the_command_trains_in_float16(data_dir, tmp_path, capsys, as_on_one_gpu):
    """The tiny model in fp16 as on one GPU: on PyTorch's layers with their fused AdamW for 4
    steps, on ours with FusedAdamW for 2 (the interpreter: seconds a step). The evaluations
    (the same batches each time) finite and falling, ours those of PyTorch's layers; the
    scale printed and in the checkpoint; a sample from it in fp16."""
    args = ["--data-dir", str(data_dir), "--batch-size", "4"]
    args += ["--learning-rate", "2e-2", "--min-lr", "2e-2"]  # large and constant: a clear fall
    losses = {}
    for layers, steps in (("--no-use-triton", "4"), ("--use-triton", "2")):
        out_dir = tmp_path / layers
        options = [layers, "--max-steps", steps, "--eval-interval", "1" if steps == "4" else "2"]
        out = run_command([*args, *options, "--out-dir", str(out_dir)], capsys)
        assert "float16 autocast (products in float16, norms and loss in float32), the loss scaled" in out
        assert "| loss scale 65536 |" in out  # GradScaler's first: no overflow in so few steps
        saved = train.read_checkpoint(out_dir / "checkpoint.pt")
        assert saved["scaler"]["scale"] == 2.0**16
        losses[layers] = [record["train_loss"] for record in saved["history"]]
    theirs, ours = losses["--no-use-triton"], losses["--use-triton"]
    assert all(math.isfinite(loss) for loss in theirs + ours)
    assert all(later < earlier - 0.03 for earlier, later in itertools.pairwise(theirs)), theirs
    assert ours == pytest.approx(theirs[1:2], abs=2e-3)  # at step 2
    checkpoint = str(tmp_path / "--no-use-triton" / "checkpoint.pt")
    sample.main(
        ["--checkpoint", checkpoint, "--prompt", "to", "--tokens", "5", "--dtype", "float16", "--no-use-triton"]
    )
    out, _ = capsys.readouterr()
    assert out.startswith("to") and len(out.rstrip("\n")) == 7


@pytest.mark.skipif(ON_GPU, reason="a CPU run: on a GPU, test_fp16_in_the_cuda_graph_on_the_gpu")
def test_an_overflow_skips_the_step_and_halves_the_scale(data_dir, tmp_path, as_on_one_gpu):
    """A loss scale of 2^100 overflows fp16's backward: the step changes no parameter, the
    scale halves, and a checkpoint keeps it. PyTorch's layers here (the interpreter is slow); our kernels' run is on the
    GPU, below, and FusedAdamW's skip is test_fused_adamw_under_a_grad_scaler_matches_torch's."""
    data = datasets.load_shakespeare(data_dir, prepare=False)
    cfg = train.parse_config([*TINY, "--out-dir", "", "--no-checkpoint", "--no-use-triton"])
    trainer = train.Trainer(cfg, data)
    trainer.run_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.scaler.update(new_scale=2.0**100)
    trainer.run_step()
    assert trainer.scaler.get_scale() == 2.0**99
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))
    trainer.save(tmp_path / "checkpoint.pt")  # the scale goes with the checkpoint
    resumed = train.Trainer(cfg, data, state=train.read_checkpoint(tmp_path / "checkpoint.pt"))
    assert resumed.scaler.get_scale() == 2.0**99
    trainer.scaler.update(new_scale=2.0**4)
    trainer.run_step()  # a good step moves them again
    assert not all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))


@pytest.mark.skipif(not ON_GPU, reason="fp16 autocast and the whole-step CUDA graph: on the GPU")
@pytest.mark.parametrize("use_triton", [True, False], ids=["ours, FusedAdamW", "torch's layers"])
def test_fp16_in_the_cuda_graph_on_the_gpu(use_triton, data_dir):
    """fp16 with the scaler inside the whole-step graph: the losses of its replays those of the
    eager step, and within 0.1 of bf16's over the last 10 of 40 steps (the same batches; on the
    CPU, fp16, fp32 and bf16 autocast on PyTorch's layers end within 0.04 of one another);
    then an overflow during a replay skips the step on the device and halves the scale."""
    data = datasets.load_shakespeare(data_dir, prepare=False)
    base = [*TINY, "--out-dir", "", "--no-checkpoint", "--n-embd", "64", "--max-steps", "40"]
    base += ["--batch-size", "16"]
    base += ["--use-triton" if use_triton else "--no-use-triton", "--eval-interval", "0"]
    runs = {}
    for dtype, step in (("float16", "eager"), ("float16", "graph"), ("bfloat16", "eager")):
        trainer = train.Trainer(train.parse_config([*base, "--dtype", dtype, "--step", step]), data)
        trainer.train(log=lambda line: None)
        runs[dtype, step] = [loss for _, loss in trainer.losses]
    assert all(math.isfinite(loss) for loss in runs["float16", "graph"])
    assert runs["float16", "graph"] == pytest.approx(runs["float16", "eager"], abs=5e-2)
    last = {key: statistics.mean(losses[-5:]) for key, losses in runs.items()}  # 2 steps each
    assert last["float16", "graph"] == pytest.approx(last["bfloat16", "eager"], abs=0.1)
    assert last["float16", "graph"] < runs["float16", "graph"][0] - 0.5
    # the last trainer ran bf16: the graph's again, then an overflow inside a replay
    trainer = train.Trainer(train.parse_config([*base, "--dtype", "float16", "--step", "graph"]), data)
    for _ in range(5):
        trainer.run_step()
    assert trainer.graph is not None
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.scaler.update(new_scale=2.0**100)
    trainer.run_step()  # a replay
    assert trainer.scaler.get_scale() == 2.0**99
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))
    trainer.scaler.update(new_scale=2.0**4)
    trainer.run_step()
    assert not all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))
