"""FusedAdamW (chapter 15) against torch.optim.AdamW(fused=True, capturable=True), the training
command's optimizer, step by step; its state dict both ways; a resumed run."""

import io

from conftest import random_tensor
import pytest
from stepkernels import FusedAdamW
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch

SHAPES = [(7, 5), (5,), (1,), (3, 2, 9), (130,), (33, 65)]


def make_params(shapes, seed=0):
    return [torch.nn.Parameter(random_tensor(s, seed=seed + i)) for i, s in enumerate(shapes)]


def groups(params, decay=0.1):
    """Two groups as the training command makes them: decayed matrices, undecayed vectors."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def torch_adamw(params, lr=3e-3, betas=(0.9, 0.99), eps=1e-8, decay=0.1):
    lr = torch.tensor(lr, device=DEVICE)
    options = dict(betas=betas, eps=eps, fused=True, capturable=True)
    return torch.optim.AdamW(groups(params, decay), lr=lr, **options)


def our_adamw(params, lr=3e-3, betas=(0.9, 0.99), eps=1e-8, decay=0.1):
    return FusedAdamW(groups(params, decay), lr=torch.tensor(lr, device=DEVICE), betas=betas, eps=eps)


def set_gradients(params, seed):
    for i, p in enumerate(params):
        g = random_tensor(p.shape, seed=1000 * seed + i, scale=0.5)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)


def assert_same_state(ours, theirs, opt_ours, opt_theirs, what):
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        where = f"{what}, parameter {i}"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
        for key in ("exp_avg", "exp_avg_sq"):
            mine = opt_ours.state[a][key]
            reference = opt_theirs.state[b].get(key, torch.zeros_like(mine))  # none: no grad yet
            message = lambda m, w=f"{where}, {key}": f"{w}: {m}"  # noqa: E731
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-7, msg=message)


@pytest.mark.parametrize(
    "betas,eps,decay", [((0.9, 0.99), 1e-8, 0.1), ((0.8, 0.999), 1e-6, 0.0), ((0.0, 0.5), 1e-8, 1.0)]
)
def test_steps_match_torch_fused_adamw(betas, eps, decay):
    ours, theirs = make_params(SHAPES), make_params(SHAPES)
    opt_ours = our_adamw(ours, betas=betas, eps=eps, decay=decay)
    opt_theirs = torch_adamw(theirs, betas=betas, eps=eps, decay=decay)
    for step in range(6):
        set_gradients(ours, step)
        set_gradients(theirs, step)
        opt_ours.step()
        opt_theirs.step()
        assert_same_state(ours, theirs, opt_ours, opt_theirs, f"step {step + 1}")


def test_learning_rate_tensor_is_read_at_each_step():
    """The rate lives in a tensor that set_learning_rate fills in place (a CUDA graph replays it)."""
    ours, theirs = make_params(SHAPES), make_params(SHAPES)
    opt_ours, opt_theirs = our_adamw(ours), torch_adamw(theirs)
    for step, lr in enumerate((1e-2, 0.0, 5e-3)):
        for optimizer in (opt_ours, opt_theirs):
            for group in optimizer.param_groups:
                group["lr"].fill_(lr)
        set_gradients(ours, step)
        set_gradients(theirs, step)
        opt_ours.step()
        opt_theirs.step()
        assert_same_state(ours, theirs, opt_ours, opt_theirs, f"lr {lr}")


def test_learning_rate_as_a_number():
    ours, theirs = make_params(SHAPES), make_params(SHAPES)
    opt_ours = FusedAdamW(groups(ours), lr=2e-3)
    opt_theirs = torch.optim.AdamW(groups(theirs), lr=2e-3, fused=True)
    for step in range(3):
        set_gradients(ours, step)
        set_gradients(theirs, step)
        opt_ours.step()
        opt_theirs.step()
    assert_same_state(ours, theirs, opt_ours, opt_theirs, "lr 2e-3")


def test_parameters_stay_where_they_are():
    """The kernel reads the parameters and gradients where they live: nothing moves them."""
    params = make_params(SHAPES)
    addresses = [p.data_ptr() for p in params]
    optimizer = our_adamw(params)
    set_gradients(params, 0)
    optimizer.step()
    assert [p.data_ptr() for p in params] == addresses


def test_gradients_at_new_addresses_each_step():
    """zero_grad(set_to_none=True) drops them; autograd allocates new ones: the table follows."""
    ours, theirs = make_params(SHAPES), make_params(SHAPES)
    opt_ours, opt_theirs = our_adamw(ours), torch_adamw(theirs)
    kept = []
    for step in range(3):
        for optimizer in (opt_ours, opt_theirs):
            optimizer.zero_grad(set_to_none=True)
        set_gradients(ours, step)
        set_gradients(theirs, step)
        kept += [p.grad for p in ours]  # kept alive: each step's at new addresses
        opt_ours.step()
        opt_theirs.step()
        assert_same_state(ours, theirs, opt_ours, opt_theirs, f"step {step + 1}")


def test_a_parameter_without_a_gradient_is_left_alone():
    ours, theirs = make_params(SHAPES), make_params(SHAPES)
    opt_ours, opt_theirs = our_adamw(ours), torch_adamw(theirs)
    set_gradients(ours, 0)
    set_gradients(theirs, 0)
    ours[1].grad = theirs[1].grad = None
    before = ours[1].detach().clone()
    opt_ours.step()
    opt_theirs.step()
    assert torch.equal(ours[1].detach(), before)
    assert_same_state(ours, theirs, opt_ours, opt_theirs, "one without a gradient")


def test_autograd_gradients():
    """The gradients a backward leaves (stolen from the product, never copied) are read."""
    ours, theirs = make_params([(4, 3), (3,)]), make_params([(4, 3), (3,)])
    opt_ours, opt_theirs = our_adamw(ours), torch_adamw(theirs)
    x = random_tensor((2, 4), seed=9)
    for params in (ours, theirs):
        (x @ params[0] + params[1]).square().sum().backward()
    opt_ours.step()
    opt_theirs.step()
    assert_same_state(ours, theirs, opt_ours, opt_theirs, "after a backward")


def save_and_load(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("save_with,load_with", [("ours", "ours"), ("ours", "torch"), ("torch", "ours")])
def test_resume_from_a_state_dict(save_with, load_with):
    """Three steps, a checkpoint, three more steps in a fresh optimizer: as six without a break."""
    make = {"ours": our_adamw, "torch": torch_adamw}
    straight = make_params(SHAPES)
    opt_straight = our_adamw(straight)
    first = make_params(SHAPES)
    opt_first = make[save_with](first)
    for step in range(3):
        for params, optimizer in ((straight, opt_straight), (first, opt_first)):
            set_gradients(params, step)
            optimizer.step()
    weights = save_and_load([p.detach().clone() for p in first])
    state = save_and_load(opt_first.state_dict())
    resumed = [torch.nn.Parameter(w.to(DEVICE)) for w in weights]
    opt_resumed = make[load_with](resumed)
    opt_resumed.load_state_dict(state)
    for step in range(3, 6):
        for params, optimizer in ((straight, opt_straight), (resumed, opt_resumed)):
            set_gradients(params, step)
            optimizer.step()
    assert_same_state(resumed, straight, opt_resumed, opt_straight, f"{save_with} -> {load_with}")
    if load_with == "ours":
        assert float(opt_resumed.state_dict()["state"][0]["step"]) == 6


def test_state_dict_has_torch_adamw_layout():
    params = make_params(SHAPES)
    optimizer = our_adamw(params)
    set_gradients(params, 0)
    optimizer.step()
    state = optimizer.state_dict()
    assert sorted(state["state"]) == list(range(len(SHAPES)))
    entry = state["state"][0]
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq"} and float(entry["step"]) == 1
    steps = [entry["step"] for entry in state["state"].values()]
    assert len({s.data_ptr() for s in steps}) == len(steps), "each parameter's own step tensor"


def test_refusals():
    with pytest.raises(TypeError, match="float32"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, device=DEVICE, dtype=torch.float16))])
    with pytest.raises(ValueError, match="betas"):
        FusedAdamW(make_params([(3,)]), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        FusedAdamW(make_params([(3,)]), lr=-1.0)
    with pytest.raises(TypeError, match="lr must be a number"):
        FusedAdamW(make_params([(3,)]), lr="0.1")
    with pytest.raises(TypeError, match="one float"):
        FusedAdamW(make_params([(3,)]), lr=torch.tensor([1, 2]))
    optimizer = FusedAdamW(make_params([(3,)]), lr=torch.tensor(1e-3, device="meta"))
    set_gradients(optimizer.param_groups[0]["params"], 0)
    with pytest.raises(ValueError, match="lr is a tensor on meta"):
        optimizer.step()
    params = make_params([(3, 4)])
    optimizer = FusedAdamW(params)
    params[0].grad = random_tensor((4, 3)).t()
    with pytest.raises(ValueError, match="contiguous gradients"):
        optimizer.step()
    with pytest.raises(ValueError, match="contiguous"):
        FusedAdamW([torch.nn.Parameter(random_tensor((4, 3)).t())])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and full size need a GPU")
def test_full_size_in_a_cuda_graph():
    """The Shakespeare model's 10.7M parameters, the step recorded as a CUDA graph and replayed
    with new gradients and learning rates, against PyTorch's fused AdamW replayed the same way."""
    from stepkernels import GPT, GPTConfig

    shapes = [p.shape for p in GPT(GPTConfig(84)).parameters()]
    ours, theirs = make_params(shapes), make_params(shapes)
    opt_ours, opt_theirs = our_adamw(ours), torch_adamw(theirs)
    sources = [random_tensor(p.shape, seed=50 + i) for i, p in enumerate(ours)]
    scale = torch.ones((), device=DEVICE)

    def step(params, optimizer):
        """A backward that allocates the gradients (inside the graph: in its pool), then the step."""
        optimizer.zero_grad(set_to_none=True)
        sum((p * s * scale).sum() for p, s in zip(params, sources, strict=True)).backward()
        optimizer.step()

    graphs = []
    for params, optimizer in ((ours, opt_ours), (theirs, opt_theirs)):
        step(params, optimizer)  # eager first: PyTorch's makes its state, outside the graph
        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            step(params, optimizer)
        graphs.append(graph)
    for step_index in range(4):
        scale.fill_(0.5 + step_index)  # new gradients: sources x scale
        for optimizer in (opt_ours, opt_theirs):
            for group in optimizer.param_groups:
                group["lr"].fill_(1e-3 * (step_index + 1))
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        assert_same_state(ours, theirs, opt_ours, opt_theirs, f"replay {step_index + 1}")
    # An eager step on the graph's own gradients (their addresses those of the capture,
    # whose copy of the table ran only at the replays): the table must be written again.
    for optimizer in (opt_ours, opt_theirs):
        optimizer.step()
    torch.cuda.synchronize()
    assert_same_state(ours, theirs, opt_ours, opt_theirs, "an eager step after the replays")
