"""ops.adamw.cast_joined (chapter 15) and chapter 12's cast_all: the weights cast into one buffer
in one launch, each read once, against PyTorch's casts; its table kept for a CUDA graph."""

import math

import pytest
from stepkernels.models import gpt
from stepkernels.models.gpt import cast_all
from stepkernels.ops import adamw
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch

SHAPES = [(65, 16), (48,), (5000,), (3, 7), (1,), (4097,), (384, 384)]


def tensors(shapes=SHAPES, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator).to(DEVICE) for s in shapes]


def same_cast(got, source, dtype):
    """Rounded to nearest, ties to even, as PyTorch casts (by hand to bf16 under the
    interpreter, whose own conversion truncates)."""
    assert got.shape == source.shape and got.dtype == dtype
    assert torch.equal(got, source.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shapes", [SHAPES, [(384, 384), (384,)], [(7,)]], ids=["odd", "aligned", "one"])
def test_casts_each_tensor_into_its_place(dtype, shapes):
    sources = tensors(shapes)
    casts = adamw.cast_joined(dtype, sources)
    for got, source in zip(casts, sources, strict=True):
        same_cast(got, source, dtype)
    base = casts[0].untyped_storage().data_ptr()
    starts = [(c.data_ptr() - base) // c.element_size() for c in casts]
    assert all(start % adamw.CAST_ALIGN == 0 for start in starts)  # wide stores
    ends = [start + c.numel() for start, c in zip(starts, casts, strict=True)]
    assert all(end <= start for end, start in zip(ends, starts[1:], strict=False))  # no overlap


def test_the_table_is_kept_and_read_afresh():
    sources = tensors(seed=1)
    adamw.cast_joined(torch.bfloat16, sources)
    kept = len(adamw.CAST_TABLES)
    sources[2].mul_(-3)  # the same tensors, new values: the same table, the new values
    casts = adamw.cast_joined(torch.bfloat16, sources)
    assert len(adamw.CAST_TABLES) == kept
    same_cast(casts[2], sources[2], torch.bfloat16)


def test_rounds_ties_to_even_and_keeps_specials():
    # bf16 keeps 8 bits of significand: 1 + 2^-8 is a tie (to 1), 1 + 3 * 2^-8 one (up)
    values = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.4e38, float("inf"), float("nan"), 0.0]
    source = torch.tensor(values, device=DEVICE)
    (cast,) = adamw.cast_joined(torch.bfloat16, [source])
    torch.testing.assert_close(cast, source.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


def test_refuses_what_it_cannot_join():
    x = torch.randn(8, 6, device=DEVICE)
    assert adamw.cast_joined(torch.bfloat16, [x.t()]) is None  # strides
    assert adamw.cast_joined(torch.bfloat16, [x, x.half()]) is None  # dtypes
    assert adamw.cast_joined(torch.bfloat16, []) is None
    if ON_GPU:  # host tensors on a GPU machine, or tensors of two devices: no kernel reads them
        assert adamw.cast_joined(torch.bfloat16, [x.cpu()]) is None
        assert adamw.cast_joined(torch.bfloat16, [x, x.cpu()]) is None


def test_cast_all_forward_and_backward():
    weights = [t.requires_grad_() for t in tensors(seed=2)]
    casts = cast_all(torch.bfloat16, *weights)
    for got, weight in zip(casts, weights, strict=True):
        same_cast(got.detach(), weight.detach(), torch.bfloat16)
    scales = [float(i + 1) for i in range(len(casts))]
    sum((c.float() * s).sum() for c, s in zip(casts, scales, strict=True)).backward()
    for weight, s in zip(weights, scales, strict=True):
        assert weight.grad.dtype == torch.float32 and torch.equal(weight.grad, torch.full_like(weight, s))


def test_cast_all_casts_each_way_in_one_launch(monkeypatch):
    calls, cast_joined = [], adamw.cast_joined

    def spy(dtype, tensors):
        calls.append((dtype, len(tensors)))
        return cast_joined(dtype, tensors)

    monkeypatch.setattr(gpt, "cast_joined", spy)
    weights = [t.requires_grad_() for t in tensors(seed=6)]
    casts = cast_all(torch.bfloat16, *weights)
    sum(c.float().sum() for c in casts[1:]).backward()  # the first unused: no gradient
    assert calls == [(torch.bfloat16, len(weights)), (torch.float32, len(weights) - 1)]
    assert weights[0].grad is None and all(torch.equal(w.grad, torch.ones_like(w)) for w in weights[1:])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: on the GPU")
def test_a_graph_replays_the_cast_of_the_weights_as_they_are():
    sources = tensors(seed=3)
    adamw.cast_joined(torch.bfloat16, sources)  # the table, written outside the recording
    other_sizes = tensors(shapes=[(9,), (4, 4)], seed=4)  # made before: no copy while recording
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        casts = adamw.cast_joined(torch.bfloat16, sources)
        unknown = adamw.cast_joined(torch.bfloat16, other_sizes)  # sizes never laid out: refused
    assert casts is not None and unknown is None
    for seed in range(5, 5 + adamw.CAST_TABLES_KEPT):  # other tables push the graph's out
        adamw.cast_joined(torch.bfloat16, tensors(seed=seed))
    for t in sources:
        t.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    for got, source in zip(casts, sources, strict=True):
        same_cast(got, source, torch.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: on the GPU")
def test_a_graph_records_the_cast_of_tensors_made_while_recording():
    """Gradients are made in the recording (the graph's memory): their table is copied
    from rows pinned by an eager call of the same sizes, which the replays copy again."""
    shapes = [(65, 16), (48,), (5000,)]
    adamw.cast_joined(torch.float32, [torch.zeros(s, device=DEVICE, dtype=torch.bfloat16) for s in shapes])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        made = [torch.arange(math.prod(s), device=DEVICE).view(s).to(torch.bfloat16) for s in shapes]
        casts = adamw.cast_joined(torch.float32, made)
    assert casts is not None
    graph.replay()
    torch.cuda.synchronize()
    for got, source in zip(casts, made, strict=True):
        same_cast(got, source, torch.float32)
