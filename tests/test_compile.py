"""torch.compile over our operators: the kernels as Inductor copies them, each registered
operator traced without a graph break, and the GPT compiled whole."""

import builtins
import dis
import importlib
import importlib.util
import inspect
import pkgutil
import textwrap

import pytest
import stepkernels  # noqa: F401  (chooses the interpreter before triton is imported)
import stepkernels.ops
from torch._inductor.codegen.wrapper import (
    user_defined_triton_kernel_transitive_closure_source_code as inductor_source,
)
import triton
from triton.runtime.interpreter import InterpretedFunction


def jit_function(value):
    """The @triton.jit function under lean, autotune or heuristics layers, else None."""
    for _ in range(4):
        if isinstance(value, (triton.runtime.JITFunction, InterpretedFunction)):
            return value
        value = getattr(value, "kernel", None) or getattr(value, "fn", None)
        if value is None:
            return None
    return None


def launched_kernels():
    """Every kernel an operation module launches (device functions come with them)."""
    found = {}
    for info in pkgutil.iter_modules(stepkernels.ops.__path__):
        module = importlib.import_module(f"stepkernels.ops.{info.name}")
        for name, value in vars(module).items():
            jit = jit_function(value)
            launched = jit is not None and jit is not value  # under lean or autotune
            if launched and jit.fn.__module__ == module.__name__:
                found[f"{info.name}.{name}"] = jit
    return found


KERNELS = launched_kernels()
# Chapter 07's kernel builds an Epilogue (a NamedTuple class) in its signature: Inductor copies
# functions and int, str and bool globals, not classes. So the matmul and the linear layer stay
# opaque operators (custom_op), which Inductor calls rather than recompiles. Chapter 11's
# attention kernels (under @lean) read a Tiling, a NamedTuple class, too; they take TMA
# descriptors built on the host, which no graph can hold, so attention is a custom_op, and its
# kernels launch only inside it (attention_forward, attention_backward): Inductor never copies
# them. The strict xfail says when one becomes copyable.
NOT_COPIED = {
    "matmul_hopper.matmul_tma_tuned": "Epilogue",
    **{f"attention.attention_{kernel}_kernel": "Tiling" for kernel in ("forward", "query_grad", "key_grads")},
}


def source_of(function) -> str:
    """A kernel's source from its ``def``, as Triton's ``JITFunction.src`` holds it."""
    lines = textwrap.dedent(inspect.getsource(function.fn)).splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("def "))
    return "".join(lines[first:])


def test_kernels_found():
    assert "dropout.bias_act_dropout_kernel" in KERNELS and len(KERNELS) > 10


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(strict=True, reason=f"Inductor cannot copy {NOT_COPIED[name]}"),
        )
        if name in NOT_COPIED
        else name
        for name in sorted(KERNELS)
    ],
)
def test_inductor_copies_every_name_a_kernel_reads(name, monkeypatch, tmp_path):
    """Inductor compiles a Triton kernel from a copy of its source, with the @triton.jit
    functions the kernel names and its int, str and bool globals
    (``user_defined_triton_kernel_transitive_closure_source_code``); a function read from a
    module (``activations.apply_activation``) is not copied, and the compiled step died
    with ``NameError: activations is not defined``. We import the copy as Inductor does and
    look up every global name each of its functions reads. Under the interpreter our
    kernels are ``InterpretedFunction``s, so we let Inductor's walk take them for
    ``JITFunction``s."""
    if INTERPRET:
        monkeypatch.setattr(triton, "JITFunction", InterpretedFunction)
        monkeypatch.setattr(InterpretedFunction, "src", property(source_of), raising=False)
    source = inductor_source(KERNELS[name])
    path = tmp_path / f"copied_{name.replace('.', '_')}.py"
    path.write_text(f"import triton\nimport triton.language as tl\n\n\n@triton.jit\n{source}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a NameError here: a default read from a global
    namespace = vars(module)
    missing = set()
    for function in namespace.values():
        if isinstance(function, (triton.runtime.JITFunction, InterpretedFunction)):
            reads = {i.argval for i in dis.Bytecode(function.fn) if i.opname == "LOAD_GLOBAL"}
            missing |= {n for n in reads if n not in namespace and not hasattr(builtins, n)}
    assert not missing, f"{name}: Inductor's copy reads {sorted(missing)}, never defined"


# ---------------------------------------------------------------------------------------------
# Our operators under torch.compile. Under the interpreter (CPU) torch.library.wrap_triton
# hands an interpreted kernel back unwrapped, so no graph can hold it: there the compiler keeps
# each triton_op opaque (decompose_custom_triton_ops=False) and aot_eager runs it as an
# operator; Inductor on a GPU traces into the kernels.

import copy  # noqa: E402

from conftest import random_tensor  # noqa: E402
from stepkernels.models.gpt import GPT, GPTConfig  # noqa: E402
from stepkernels.ops.add_layer_norm import add_layer_norm  # noqa: E402
from stepkernels.ops.attention import attention  # noqa: E402
from stepkernels.ops.cross_entropy import cross_entropy  # noqa: E402
from stepkernels.ops.dropout import dropout, dropout_bias_act  # noqa: E402
from stepkernels.ops.layer_norm import layer_norm  # noqa: E402
from stepkernels.ops.linear import linear  # noqa: E402
from stepkernels.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from stepkernels.ops.matmul import matmul  # noqa: E402
from stepkernels.ops.softmax import log_softmax, softmax  # noqa: E402
from stepkernels.runtime.core import DEVICE, INTERPRET, ON_GPU  # noqa: E402
import torch  # noqa: E402

BACKEND = "inductor" if ON_GPU else "aot_eager"


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend=BACKEND, fullgraph=True)


def opaque_on_cpu():
    """The interpreter's kernels cannot enter a graph: keep triton_ops whole there."""
    if ON_GPU:
        return torch._functorch.config.patch({})
    return torch._functorch.config.patch(decompose_custom_triton_ops=False)


def leaf(shape, seed, dtype=torch.float32):
    return random_tensor(shape, dtype, seed=seed).requires_grad_()


def op_cases():
    """name: (function, its tensor arguments): every operator the GPT uses."""
    x, w, b = leaf((6, 3, 32), 0), leaf(32, 1), leaf(32, 2)
    q, k, v = (leaf((2, 2, 16, 16), s) for s in (3, 4, 5))
    logits, target = leaf((12, 40), 6), torch.randint(40, (12,), device=DEVICE)
    weight = leaf((24, 32), 7)
    a, m = leaf((18, 32), 8), leaf((32, 32), 9)
    x2d, weight40 = leaf((12, 32), 10), leaf((40, 32), 11)
    seed = torch.tensor(1234, device=DEVICE)
    update = leaf((6, 3, 32), 12)
    return {
        "layer_norm": (lambda x, w, b: layer_norm(x, (32,), w, b), (x, w, b)),
        "add_layer_norm": (  # h and y, both with a gradient
            lambda x, r, w, b: torch.stack(add_layer_norm(x, r, (32,), w, b)),
            (x, update, w, b),
        ),
        "add_layer_norm_y": (  # h unused: no gradient of its own
            lambda x, r, w, b: add_layer_norm(x, r, (32,), w, b)[1],
            (x, update, w, b),
        ),
        "dropout": (lambda x: dropout(x, 0.25, seed), (x,)),
        "dropout_int_seed": (lambda x: dropout(x, 0.25, 77), (x,)),
        "dropout_bias_act": (
            lambda x, b: dropout_bias_act(x, b, 0.25, "gelu", seed),
            (x, b),
        ),
        "dropout_bias": (lambda x, b: dropout_bias_act(x, b, 0.25, None, 5), (x, b)),
        "attention": (lambda q, k, v: attention(q, k, v, causal=True), (q, k, v)),
        "cross_entropy": (lambda z: cross_entropy(z, target), (logits,)),
        "cross_entropy_none": (
            lambda z: cross_entropy(z, target, reduction="none"),
            (logits,),
        ),
        "linear_gelu": (lambda x, w: linear(x, w, None, "gelu"), (x, weight)),
        "softmax": (lambda x: softmax(x), (x,)),
        "log_softmax_dim1": (lambda x: log_softmax(x, 1), (x,)),
        "matmul_relu": (
            lambda a, m: matmul(a, m, "relu", bias=m[0].detach()),
            (a.detach(), m.detach()),
        ),
        "matmul_accumulate": (
            lambda a, m: matmul(a, m, accumulate=torch.ones(18, 32, device=DEVICE)),
            (a.detach(), m.detach()),
        ),
        "linear_cross_entropy": (
            lambda x, w: linear_cross_entropy(x, w, target),
            (x2d, weight40),
        ),
        "linear_cross_entropy_none": (
            lambda x, w: linear_cross_entropy(x, w, target, reduction="none"),
            (x2d, weight40),
        ),
    }


CASES = sorted(op_cases())


def outputs_and_grads(fn, args):
    out = fn(*args)
    if not out.requires_grad:  # an operator without a derivative (matmul)
        return out, ()
    cotangent = random_tensor(out.shape, out.dtype, seed=99)
    return out, torch.autograd.grad(out, args, cotangent)


@pytest.mark.parametrize("name", CASES)
def test_operator_traces_whole(name):
    fn, args = op_cases()[name]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", CASES)
def test_compiled_operator_matches_eager(name):
    fn, args = op_cases()[name]
    want, want_grads = outputs_and_grads(fn, args)
    with opaque_on_cpu():
        got, got_grads = outputs_and_grads(compiled(fn), args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def small_gpt(dropout=0.1):
    torch.manual_seed(0)
    # One block under the interpreter (its kernels run interpreted, in eager and compiled
    # alike: a second block would double that and trace nothing new); two on a GPU.
    n_layer = 2 if ON_GPU else 1
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32)
    return GPT(dataclasses_replace(config, dropout=dropout)).to(DEVICE)


def dataclasses_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def tokens():
    generator = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(64, (2, 2, 16), generator=generator).to(DEVICE)
    return idx, targets


def test_gpt_traces_whole_on_our_kernels():
    """The GPT on our kernels, with dropout, is one graph: no break."""
    model = small_gpt()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*tokens())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def step(model, idx, targets, forward=None):
    logits, loss = (model if forward is None else forward)(idx, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits, loss, grads


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiled_gpt_matches_eager(dropout):
    """Logits, loss and every gradient of the compiled GPT equal our eager ones (dropout
    too: both draw from the same device seeds, which both advance)."""
    eager = small_gpt(dropout)
    model = copy.deepcopy(eager)
    want = step(eager, *tokens())
    with opaque_on_cpu():
        got = step(model, *tokens(), forward=compiled(model))
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5)


def opcheck_cases():
    """Each registered operator with arguments it takes."""
    ops = torch.ops.stepkernels
    x, w, b = leaf((6, 32), 0), leaf(32, 1), leaf(32, 2)
    y, mean, rstd = ops.layer_norm_forward(x, w, b, 1e-5)
    q, k, v = (leaf((1, 2, 16, 16), s) for s in (3, 4, 5))
    o, lse = ops.attention(q, k, v, True, 0.25)
    logits, target = leaf((12, 40), 6), torch.randint(40, (12,), device=DEVICE)
    seed = torch.tensor(7, device=DEVICE)
    weight40 = leaf((40, 32), 7)
    dy = random_tensor((6, 32), seed=8)
    update = leaf((6, 32), 12)
    h, _, h_mean, h_rstd = ops.add_layer_norm_forward(x, update, w, b, 1e-5, None)
    return {
        "add_layer_norm_forward": (
            ops.add_layer_norm_forward,
            (x, update, w, b, 1e-5, torch.float16),
        ),
        "add_layer_norm_backward": (
            ops.add_layer_norm_backward,
            (h.detach(), dy, random_tensor((6, 32), seed=13), w.detach(), h_mean.detach(), h_rstd.detach()),
        ),
        "add_layer_norm_backward_low_dtype": (
            ops.add_layer_norm_backward,
            (h.detach(), dy, None, w.detach(), h_mean.detach(), h_rstd.detach(), torch.bfloat16),
        ),
        "add_layer_norm_backward_no_dh": (
            ops.add_layer_norm_backward,
            (h.detach(), dy, None, None, h_mean.detach(), h_rstd.detach()),
        ),
        "layer_norm_forward": (ops.layer_norm_forward, (x, w, b, 1e-5)),
        "layer_norm_backward": (
            ops.layer_norm_backward,
            (dy, x.detach(), w.detach(), mean.detach(), rstd.detach(), True, True),
        ),
        "dropout": (ops.dropout, (x, 0.25, seed)),
        "dropout_bias_act": (ops.dropout_bias_act, (x, b, 0.25, "gelu", seed)),
        "dropout_bias_act_backward": (
            ops.dropout_bias_act_backward,
            (dy, x.detach(), b.detach(), 0.25, "gelu", seed),
        ),
        "softmax": (ops.softmax, (x, True)),
        "softmax_backward": (ops.softmax_backward, (y.detach(), dy, False)),
        "attention": (ops.attention, (q, k, v, True, 0.25)),
        "attention_backward": (
            ops.attention_backward,
            (*(t.detach() for t in (q, k, v, o, lse)), random_tensor(q.shape, seed=9), True, 0.25),
        ),
        "cross_entropy": (ops.cross_entropy, (logits, target, -100, 0.1, "mean", True)),
        "cross_entropy_backward": (
            ops.cross_entropy_backward,
            (logits.detach(), target, torch.rand(12, device=DEVICE), -100, 0.0),
        ),
        "matmul": (ops.matmul, (x.detach(), w.detach().expand(32, 32), "relu", b.detach(), True, None)),
        "linear_cross_entropy": (
            ops.linear_cross_entropy,
            (x[:, :32].repeat(2, 1), weight40, None, target, -100, 0.0, "mean", None, [True, True, False]),
        ),
        "fused_linear": (ops.fused_linear, (x, weight40, None, "gelu", True)),
    }


# Under the interpreter the test that decomposes a triton_op into its kernels cannot run.
OPCHECKS = None if ON_GPU else ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("name", sorted(opcheck_cases()))
def test_opcheck(name):
    """torch.library.opcheck: the schema, the autograd registration, the fake (meta)
    implementation against the real outputs, and on a GPU AOT dispatch too."""
    op, args = opcheck_cases()[name]
    kwargs = {} if OPCHECKS is None else {"test_utils": OPCHECKS}
    torch.library.opcheck(op, args, **kwargs)


@pytest.mark.parametrize("name", sorted(opcheck_cases()))
def test_operator_traces_with_symbolic_shapes(name):
    """Traced with symbolic shapes, as torch.compile(dynamic=True) and opcheck's AOT test do:
    launch rules cached by shape got a SymInt ("unhashable type") before the operators
    specialized on their shapes (``concrete``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    op, args = opcheck_cases()[name]
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    graph = make_fx(lambda *a: op(*a), tracing_mode="symbolic")(*detached)
    assert any(n.op == "call_function" for n in graph.graph.nodes)
