"""lab/step_profile.py at its toy size: the table and the CSV that chapter 15 shows. On a CPU the
profiler sees PyTorch's operators (the interpreter's kernels are Python), so this checks the
script's plumbing; on a GPU it profiles kernels."""

import csv
import importlib.util
from pathlib import Path

import pytest
import small_text
from stepkernels.models import data as datasets
from stepkernels.runtime.core import ON_GPU

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", ROOT / "lab" / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def small_data(tmp_path, monkeypatch, step_profile):
    """A prepared dataset of small_text.TEXT, as tests/test_train_cli.py uses."""
    small_text.prepare(tmp_path)
    monkeypatch.setattr(step_profile, "load_shakespeare", lambda: datasets.load_shakespeare(tmp_path))


def test_toy_profile_writes_the_table(step_profile, small_data, tmp_path, capsys):
    path = tmp_path / "profile.csv"
    step_profile.main(["--shape", "toy", "--csv", str(path)])
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == set(step_profile.FIELDS)
    providers = ["torch", "triton"] + (["torch + CUDA graph", "triton + CUDA graph"] if ON_GPU else [])
    assert sorted({r["provider"] for r in rows}) == sorted(providers)
    for provider in providers:
        mine = [r for r in rows if r["provider"] == provider]
        assert 1 <= len(mine) <= step_profile.TOP + 1
        assert [int(r["rank"]) for r in mine] == list(range(1, len(mine) + 1))
        times = [float(r["us_per_step"]) for r in mine[: step_profile.TOP]]
        assert times == sorted(times, reverse=True), "ranked by total time"
        assert all(float(r["step_ms"]) > 0 and float(r["count_per_step"]) > 0 for r in mine)
        assert sum(float(r["share_of_step"]) for r in mine) <= 1.05 or not ON_GPU
    out = capsys.readouterr().out
    assert "a step" in out and f"wrote {path}" in out


def test_refuses_graphs_without_a_gpu(step_profile, tmp_path):
    if ON_GPU:
        pytest.skip("a GPU runs graphs")
    with pytest.raises(SystemExit):
        step_profile.main(["--shape", "toy", "--provider", "torch + CUDA graph", "--csv", str(tmp_path / "x.csv")])


def test_the_add_norm_ablation_runs_the_addition_apart(step_profile, monkeypatch):
    """--ablate's "add then norm": the GPT's layers never call add_layer_norm inside, and the
    loss is the fused one's (fp32)."""
    from stepkernels.models import gpt
    from stepkernels.runtime.core import DEVICE
    import torch

    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(20, block_size=8, n_layer=1, n_head=2, n_embd=16)).to(DEVICE)
    idx = torch.randint(20, (2, 8), device=DEVICE)
    fused = model(idx, idx)[1]

    def refuse(*args, **kwargs):
        raise AssertionError("add_layer_norm called in the ablation")

    monkeypatch.setattr(gpt, "add_layer_norm", refuse)
    with step_profile.undone("add_norm"):
        apart = model(idx, idx)[1]
    assert gpt.TritonLayers is not step_profile.AddThenNorm, "restored on leaving"
    torch.testing.assert_close(apart, fused, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="add_layer_norm called"):
        model(idx, idx)
