"""Run by tests/test_launch_call_path.py in a process of its own, without a GPU and without
Triton's interpreter (as lab/call_cost.py): every launch reaches a launcher that records what
it was passed. Prints, per call, whether its repeat took the bound launches and whether it
passed the launchers the same grids, integers, constexprs and tensors (by role) as the call
launched by key before it."""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
import stepkernels  # noqa: E402
from stepkernels.runtime import launch  # noqa: E402
from stepkernels.runtime.launch import PLAN_CACHES, LeanKernel  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

PASSED: list = []  # what each launcher call was passed


class Recorder:
    function = packed_metadata = None

    @staticmethod
    def run(*args):
        PASSED.append(args)


class NoCompile:
    def __getitem__(self, grid):
        return lambda *args, **meta: Recorder


FIRST_LAUNCH, LAUNCH = LeanKernel.first_launch, LeanKernel.launch
KEYED = []  # launches that took LeanKernel's keyed path


def first_launch(self, key, grid, args, meta):
    kernel, self.kernel = self.kernel, NoCompile()
    try:
        if self.tuned is not None:
            self.tuned.best_config = self.tuned.configs[0]
        return FIRST_LAUNCH(self, key, grid, args, meta)
    finally:
        self.kernel = kernel


def keyed_launch(self, grid, args, meta):
    KEYED.append(self)
    return LAUNCH(self, grid, args, meta)


LeanKernel.first_launch, LeanKernel.launch = first_launch, keyed_launch
LeanKernel.bind_runtime = lambda self: (
    setattr(self, "runtime", (lambda: 0, lambda device: 0, triton.knobs.runtime)) or self.runtime
)


def roles(passed, inputs):
    """A launcher's arguments with each tensor named by its role: an input's index, or the
    order in which the call's new tensors first appear (so aliasing shows)."""
    known = {t.data_ptr(): f"input {i}" for i, t in enumerate(inputs)}
    new: dict = {}
    out = []
    for args in passed:
        row = []
        for a in args[9:]:  # after grid, stream, function, metadata and hooks
            described = getattr(a, "base", None)  # a host tensor descriptor
            t = a if described is None else described
            if isinstance(t, torch.Tensor):
                ptr = t.data_ptr()
                t = known.get(ptr) or new.setdefault(ptr, f"new {len(new)}")
            if described is not None:  # its tensor's role, shape, strides and block
                t = (t, a.shape, a.strides, a.block_shape)
            row.append(repr(t))
        out.append([*map(repr, args[:3]), *row])
    return out


def calls():
    g = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=g).half()
    x, w, b = make(16, 64), make(64), make(64)
    x3 = make(2, 8, 64)
    leaf = lambda t: t.clone().requires_grad_()
    xl, wl, bl = leaf(x), leaf(w), leaf(b)

    def fwd_bwd(fn, leaves):
        out = fn()
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    layer_norm = stepkernels.layer_norm
    target = torch.randint(64, (16,), generator=g)
    odd = make(7, 64)[:, 3:53]  # rows of 50 with gaps, off the 16-byte grid
    odd_target = torch.randint(50, (7,), generator=g).int()
    odd_leaf = leaf(odd)
    ce = stepkernels.cross_entropy
    w64, w50, b64, b128 = make(64, 64), make(64, 50), make(64), make(128)
    wl64, bl64 = leaf(w64), leaf(b64)
    q, kv = make(2, 4, 40, 32), make(2, 2, 40, 32)  # grouped heads, odd sequences
    ql, kl, vl = leaf(q), leaf(kv), leaf(kv)
    attention = stepkernels.attention
    return {
        "softmax": (lambda: stepkernels.softmax(x), [x]),
        "log_softmax 3-D": (lambda: stepkernels.log_softmax(x3), [x3]),
        "softmax fwd+bwd": (
            lambda: fwd_bwd(lambda: stepkernels.softmax(xl), [xl]),
            [xl],
        ),
        "layer_norm": (lambda: layer_norm(x, (64,), w, b), [x, w, b]),
        "layer_norm no bias": (lambda: layer_norm(x, 64, w), [x, w]),
        "layer_norm fwd+bwd": (
            lambda: fwd_bwd(lambda: layer_norm(xl, (64,), wl, bl), [xl, wl, bl]),
            [xl, wl, bl],
        ),
        "layer_norm fwd+bwd x only": (
            lambda: fwd_bwd(lambda: layer_norm(xl, (64,), w, b), [xl]),
            [xl, w, b],
        ),
        "cross_entropy": (lambda: ce(x, target), [x, target]),
        "matmul": (lambda: stepkernels.matmul(x, w64.mT), [x, w64]),
        "matmul bias gelu pre-activation, odd": (
            lambda: stepkernels.matmul(odd, w50.mT, "gelu", bias=b128[1::2], return_preactivation=True),
            [odd, w50, b128],
        ),
        "linear 3-D": (lambda: stepkernels.linear(x3, w64, b64), [x3, w64, b64]),
        "linear fwd+bwd": (
            lambda: fwd_bwd(lambda: stepkernels.linear(xl, wl64, bl64), [xl, wl64, bl64]),
            [xl, wl64, bl64],
        ),
        "linear+gelu fwd+bwd": (
            lambda: fwd_bwd(lambda: stepkernels.linear(xl, wl64, bl64, "gelu"), [xl, wl64, bl64]),
            [xl, wl64, bl64],
        ),
        "linear+gelu recompute, x only": (
            lambda: fwd_bwd(lambda: stepkernels.linear(xl, w64, b64, "gelu", recompute=True), [xl]),
            [xl, w64, b64],
        ),
        "attention": (lambda: attention(q, kv, kv, causal=True), [q, kv]),
        "attention fwd+bwd, window": (
            lambda: fwd_bwd(lambda: attention(ql, kl, vl, causal=True, window=7), [ql, kl, vl]),
            [ql, kl, vl],
        ),
        "linear_cross_entropy": (
            lambda: stepkernels.linear_cross_entropy(x, w64, target, b64),
            [x, w64, target, b64],
        ),
        "linear_cross_entropy fwd+bwd": (
            lambda: fwd_bwd(lambda: stepkernels.linear_cross_entropy(xl, wl64, target), [xl, wl64]),
            [xl, wl64, target],
        ),
        "cross_entropy sum, odd rows": (
            lambda: ce(odd, odd_target, ignore_index=3, reduction="sum"),
            [odd, odd_target],
        ),
        "cross_entropy fwd+bwd": (
            lambda: fwd_bwd(lambda: ce(xl, target, label_smoothing=0.1), [xl]),
            [xl, target],
        ),
        "cross_entropy fwd+bwd odd rows": (
            lambda: fwd_bwd(lambda: ce(odd_leaf, odd_target, ignore_index=2), [odd_leaf]),
            [odd_leaf, odd_target],
        ),
    }


results = {}
for name, (call, inputs) in calls().items():
    call()  # the first: Triton's path, whose launchers LeanKernel keeps
    for plans in PLAN_CACHES:
        plans.clear()
    PASSED.clear()
    call()  # checked, launched by key, its launches bound
    first = roles(PASSED, inputs)
    PASSED.clear(), KEYED.clear()
    call()  # the repeat
    results[name] = dict(bound=not KEYED, same=roles(PASSED, inputs) == first, launches=len(first))
    with launch.triton_launches():  # lean launches off: no bound ones either
        results[name]["off"] = not launch.lean_now()


def switches():
    """Pairs of calls whose keys differ in one thing (shape, dtype, strides, options): the
    second, after the first was bound."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g).half()
    target = torch.randint(64, (16,), generator=g)
    ce = stepkernels.cross_entropy
    wide = torch.randn(16, 96, generator=g).half()
    w64, b64 = torch.randn(64, 64, generator=g).half(), torch.randn(64, generator=g).half()
    x4, x5 = torch.randn(1, 2, 24, 16, generator=g).half(), torch.randn(1, 2, 40, 16, generator=g).half()
    return {
        "cross_entropy, then more rows": (
            lambda: ce(x, target),
            lambda: ce(x[:12], target[:12]),
            [x, target],
        ),
        "cross_entropy, then fp32": (
            lambda: ce(x, target),
            lambda: ce(x.float(), target),
            [x, target],
        ),
        "cross_entropy, then rows with gaps": (
            lambda: ce(x, target),
            lambda: ce(wide[:, :64], target),
            [wide, target],
        ),
        "cross_entropy, then int32 target": (
            lambda: ce(x, target),
            lambda: ce(x, target.int()),
            [x, target],
        ),
        "cross_entropy, then sum": (
            lambda: ce(x, target),
            lambda: ce(x, target, reduction="sum"),
            [x, target],
        ),
        "matmul, then a transposed operand": (
            lambda: stepkernels.matmul(x, w64),
            lambda: stepkernels.matmul(x, w64.mT),
            [x, w64],
        ),
        "matmul, then bf16": (
            lambda: stepkernels.matmul(x, w64),
            lambda: stepkernels.matmul(x.bfloat16(), w64.bfloat16()),
            [x, w64],
        ),
        "linear, then rows with gaps": (
            lambda: stepkernels.linear(x, w64, b64),
            lambda: stepkernels.linear(wide[:, :64], w64, b64),
            [wide, w64, b64],
        ),
        "linear, then gelu": (
            lambda: stepkernels.linear(x, w64, b64),
            lambda: stepkernels.linear(x, w64, b64, "gelu"),
            [x, w64, b64],
        ),
        "linear_cross_entropy, then chunks": (
            lambda: stepkernels.linear_cross_entropy(x, w64, target),
            lambda: stepkernels.linear_cross_entropy(x, w64, target, chunk_tokens=5),
            [x, w64, target],
        ),
        "attention, then a longer sequence": (
            lambda: stepkernels.attention(x4, x4, x4),
            lambda: stepkernels.attention(x5, x5, x5),
            [x4, x5],
        ),
        "attention, then causal": (
            lambda: stepkernels.attention(x4, x4, x4),
            lambda: stepkernels.attention(x4, x4, x4, causal=True),
            [x4],
        ),
        "softmax, then other rows": (
            lambda: stepkernels.softmax(x),
            lambda: stepkernels.softmax(x[:5]),
            [x],
        ),
    }


for name, (first_call, second_call, inputs) in switches().items():
    first_call(), second_call()  # Triton's path, for both keys
    for plans in PLAN_CACHES:
        plans.clear()
    PASSED.clear()
    second_call()  # launched by key, as a first call
    fresh = roles(PASSED, inputs)
    for plans in PLAN_CACHES:
        plans.clear()
    first_call(), first_call()  # bound
    PASSED.clear(), KEYED.clear()
    second_call()  # a key not seen: by key again, as if fresh
    results[name] = dict(bound=not KEYED, same=roles(PASSED, inputs) == fresh)
    results[name].update(launches=len(fresh), off=True)
json.dump(results, sys.stdout)
