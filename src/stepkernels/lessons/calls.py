"""Every public operation called as a user calls it, ours beside torch's and beside its
floor: chapter 08's benchmarks of the CPU time per call and of the call's rate.

A call is named ``"name"`` (forward alone, no input requiring a gradient) or
``"name fwd+bwd"`` (forward and backward through ``torch.autograd.grad`` with respect to the
inputs a layer trains). ``make_call`` returns the zero-argument call on fresh inputs.

``make_floor`` returns the cheapest call that does what ours must do through Triton: it
allocates the tensors ours allocates for its kernels and its results (one ``torch.empty``
each) and launches as many kernels, each an *empty* ``@triton.jit`` function with the same
parameters as ours, through the compiled kernel's launcher with every argument bound once;
with a backward, inside an ``autograd.Function`` that saves the forward's allocations. What
ours costs beyond its floor is our Python; what the floor costs beyond torch's own call is
Triton's launcher and autograd's Python node, which no wrapper of ours can remove.
"""

from collections.abc import Callable
import contextlib
import inspect
import linecache

import stepkernels
from stepkernels.runtime.launch import PLAN_CACHES, LeanKernel
import torch
import torch.nn.functional as F

SEED = 1234  # dropout's
# name: (ours, torch's, the inputs that get a gradient; None: no backward). Each takes the
# dict of inputs ``operands`` makes.
OPERATIONS = {
    "softmax": (
        lambda t: stepkernels.softmax(t["x"]),
        lambda t: torch.softmax(t["x"], -1),
        ("x",),
    ),
    "log_softmax": (
        lambda t: stepkernels.log_softmax(t["x"]),
        lambda t: torch.log_softmax(t["x"], -1),
        ("x",),
    ),
    "layer_norm": (
        lambda t: stepkernels.layer_norm(t["x"], t["x"].shape[-1:], t["w_ln"], t["b"]),
        lambda t: F.layer_norm(t["x"], t["x"].shape[-1:], t["w_ln"], t["b"]),
        ("x", "w_ln", "b"),
    ),
    "matmul": (
        lambda t: stepkernels.matmul(t["x"], t["w"].mT),
        lambda t: torch.mm(t["x"], t["w"].mT),
        None,
    ),
    "linear": (
        lambda t: stepkernels.linear(t["x"], t["w"], t["b"]),
        lambda t: F.linear(t["x"], t["w"], t["b"]),
        ("x", "w", "b"),
    ),
    "linear+gelu": (
        lambda t: stepkernels.linear(t["x"], t["w"], t["b"], "gelu"),
        lambda t: F.gelu(F.linear(t["x"], t["w"], t["b"])),
        ("x", "w", "b"),
    ),
    "dropout": (
        lambda t: stepkernels.dropout(t["x"], 0.1, SEED),
        lambda t: F.dropout(t["x"], 0.1),
        ("x",),
    ),
    "dropout_bias_act": (
        lambda t: stepkernels.dropout_bias_act(t["x"], t["b"], 0.1, "gelu", SEED),
        lambda t: F.dropout(F.gelu(t["x"] + t["b"]), 0.1),
        ("x", "b"),
    ),
    "cross_entropy": (
        lambda t: stepkernels.cross_entropy(t["x"], t["target"]),
        lambda t: F.cross_entropy(t["x"], t["target"]),
        ("x",),
    ),
    "linear_cross_entropy": (
        lambda t: stepkernels.linear_cross_entropy(t["x"], t["w"], t["target"]),
        lambda t: F.cross_entropy(F.linear(t["x"], t["w"]), t["target"]),
        ("x", "w"),
    ),
    "attention": (
        lambda t: stepkernels.attention(t["q"], t["k"], t["v"], causal=True),
        lambda t: F.scaled_dot_product_attention(
            t["q"], t["k"], t["v"], is_causal=True
        ),
        ("q", "k", "v"),
    ),
}


def labels(names=None) -> dict:
    """x value -> call, forward then forward and backward, for ``names`` (all by default)."""
    calls = [
        label
        for name, (_, _, grads) in OPERATIONS.items()
        if names is None or name in names
        for label in (name, f"{name} fwd+bwd")[: 1 if grads is None else 2]
    ]
    return dict(enumerate(calls))


def operands(rows, width, heads, device, dtype, requires_grad) -> dict:
    """Fresh inputs: x (rows, width), a square weight, a bias, a layer norm's weight, the
    attention's q, k, v of shape ``heads`` and a target of ``width`` classes."""
    make = lambda *shape, scale=1.0: (
        torch.randn(*shape, device=device, dtype=dtype) * scale
    ).requires_grad_(requires_grad)
    t = dict(x=make(rows, width), w=make(width, width, scale=width**-0.5))
    t.update(b=make(width), w_ln=make(width), q=make(*heads), k=make(*heads))
    t.update(v=make(*heads), target=torch.randint(width, (rows,), device=device))
    return t


def make_call(label, ours, rows, width, heads, device, dtype=torch.float16) -> Callable:
    """The call ``label`` (``"softmax"``, ``"softmax fwd+bwd"``...), ours or torch's."""
    name, backward = label.split()[0], label.endswith("fwd+bwd")
    mine, theirs, grads = OPERATIONS[name]
    fn = mine if ours else theirs
    t = operands(rows, width, heads, device, dtype, requires_grad=backward)
    if not backward:
        return lambda: fn(t)
    leaves, grad = [t[g] for g in grads], torch.ones_like(fn(t))
    return lambda: torch.autograd.grad(fn(t), leaves, grad)


def make_floor(
    label, rows, width, heads, device, dtype=torch.float16, compile_empty=None
) -> Callable:
    """The floor of the call ``label`` (see the module's docstring), built by recording
    one call of ours. ``compile_empty(kernel, grid, args, tail, compiled)`` gives the
    compiled empty twin of a launch (default: ``empty_twin_compiled``; the interpreter has no
    launcher: there the floor launches nothing)."""
    name, backward = label.split()[0], label.endswith("fwd+bwd")
    mine, _, grads = OPERATIONS[name]
    t = operands(rows, width, heads, device, dtype, requires_grad=backward)
    leaves = [t[g] for g in grads] if backward else []
    dy = None
    for _ in range(2):  # compiled, tuned and keyed: the second call is a repeat
        out = mine(t)
        if backward:
            dy = torch.ones_like(out) if dy is None else dy
            torch.autograd.grad(out, leaves, dy)
    known = {storage(v) for v in t.values() if isinstance(v, torch.Tensor)}
    for plans in PLAN_CACHES:  # bound launches skip kernel[grid]: record without them
        plans.clear()
    with launches_recorded() as forward:
        out = mine(t)
    phases = [Phase(forward, [out], known)]
    if backward:
        known = known | {storage(dy)} | set(phases[0].allocated)
        for plans in PLAN_CACHES:
            plans.clear()
        with launches_recorded() as backward_launches:
            results = torch.autograd.grad(out, leaves, dy)
        saved = set(phases[0].allocated)
        phases.append(Phase(backward_launches, list(results), known, saved))
    compile_empty = compile_empty or empty_twin_compiled
    for phase in phases:
        phase.bind(compile_empty)
    if not backward:
        return phases[0].floor_forward
    function = floor_function(*phases)
    call = lambda: torch.autograd.grad(function.apply(*leaves), leaves, dy)
    call.parts = (function, leaves, dy)  # for timing the forward and backward apart
    call.phases = phases
    return call


def storage(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def tensors_of(args):
    """The tensors among a launch's arguments (a tensor descriptor's too)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(getattr(a, "base", None), torch.Tensor):
            yield a.base


@contextlib.contextmanager
def launches_recorded():
    """Every launch of a lean kernel within the block: (kernel, grid, args, meta)."""
    launches, original = [], LeanKernel.__getitem__

    def recording(kernel, grid):
        launch = original(kernel, grid)
        return lambda *args, **meta: (
            launches.append((kernel, grid, args, meta)) or launch(*args, **meta)
        )

    LeanKernel.__getitem__ = recording
    try:
        yield launches
    finally:
        LeanKernel.__getitem__ = original


class Phase:
    """The forward or the backward of a floor: the tensors to allocate (new storages among
    the kernels' arguments and the results, which stand for their storage where they lie
    on one), and the launches, bound once."""

    def __init__(self, launches, results, known, saved=()):
        self.launches, self.device = launches, results[0].device
        self.allocated: dict = {}  # storage -> (shape, dtype)
        for tensor in (
            *results,
            *(t for _, _, a, _ in launches for t in tensors_of(a)),
        ):
            key = storage(tensor)
            # a result on an input's storage (not one the forward saved) gets its own
            result = any(tensor is r for r in results)
            new = key not in known or (result and key not in saved)
            if new and key not in self.allocated:
                self.allocated[key] = (tuple(tensor.shape), tensor.dtype)
        self.results = [storage(r) for r in results]  # where each result lies
        self.bound: list = []

    def bind(self, compile_empty):
        """Each launch as (run, grid, the launcher's arguments after the stream)."""
        device = self.device.index or 0
        for kernel, grid, args, meta in self.launches:
            entry = (
                None
                if kernel.always_slow
                else kernel.entries.get(kernel.key(args, meta, device))
            )
            if entry is None:  # no compiled launcher (the interpreter): nothing to call
                continue
            compiled, tail, cached_grid = entry
            grid = tuple(cached_grid or grid)
            twin = compile_empty(kernel, grid, args, tail, compiled)
            rest = (twin.function, twin.packed_metadata, None, None, None, *args, *tail)
            self.bound.append((twin.run, (*grid, 1, 1)[:3], rest))

    def allocate(self) -> list:
        device = self.device
        return [
            torch.empty(s, dtype=d, device=device) for s, d in self.allocated.values()
        ]

    def launch(self):
        if self.bound:
            stream = current_stream(self.device)
            for run, grid, rest in self.bound:
                run(*grid, stream, *rest)

    def floor_forward(self):
        tensors = self.allocate()
        self.launch()
        return tensors[list(self.allocated).index(self.results[0])]


def current_stream(device):
    if device.type != "cuda":
        return 0
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(device.index)


def floor_function(forward: Phase, backward: Phase):
    """An ``autograd.Function`` whose forward and backward are the phases' floors; a
    gradient lies on a tensor the backward allocates or on one the forward saved."""
    saved_at = list(forward.allocated)
    output = saved_at.index(forward.results[0])

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *leaves):
            tensors = forward.allocate()
            forward.launch()
            ctx.save_for_backward(*tensors)
            return tensors[output]

        @staticmethod
        def backward(ctx, dy):
            saved, tensors = ctx.saved_tensors, backward.allocate()
            backward.launch()
            where = dict(zip(saved_at, saved, strict=True))
            where.update(zip(backward.allocated, tensors, strict=True))
            return tuple(where[key] for key in backward.results)

    return Floor


EMPTY_TWINS: dict = {}  # a kernel's Python function -> its empty twin


def empty_twin(kernel: LeanKernel):
    """A ``@triton.jit`` function with ``kernel``'s parameters (its constexprs and
    unspecialized integers kept) and no body."""
    import triton

    layers = [kernel.kernel]  # Autotuner, Heuristics, JITFunction, the Python function
    while hasattr(layers[-1], "fn"):
        layers.append(layers[-1].fn)
    function = layers[-1]
    if function not in EMPTY_TWINS:
        signature = inspect.signature(function).parameters.values()
        constexpr = lambda p: "constexpr" in str(p.annotation)
        params = [
            f"{p.name}: tl.constexpr" if constexpr(p) else p.name for p in signature
        ]
        jit = next((f for f in layers if hasattr(f, "params")), None)  # not interpreted
        unspecialized = [
            p.name for p in getattr(jit, "params", ()) if p.do_not_specialize
        ]
        name = f"empty_{function.__name__}"
        source = f"def {name}({', '.join(params)}):\n    pass\n"
        filename = f"<stepkernels floor: {name}>"  # inspect (and Triton) read it here
        linecache.cache[filename] = (
            len(source),
            None,
            source.splitlines(True),
            filename,
        )
        namespace = {"tl": triton.language, "__name__": __name__}
        exec(compile(source, filename, "exec"), namespace)
        twin = triton.jit(do_not_specialize=unspecialized)(namespace[name])
        EMPTY_TWINS[function] = twin
    return EMPTY_TWINS[function]


def empty_twin_compiled(kernel, grid, args, tail, compiled):
    """The empty twin of ``kernel`` compiled for these arguments, launched once."""
    twin = empty_twin(kernel)
    options = {"num_warps": compiled.metadata.num_warps}
    done = twin[grid](*args, *tail, **options)
    return done.result() if hasattr(done, "result") else done
