r"""Cheap kernel launches: Triton's argument binding done once per shape, not at every call.

``kernel[grid](*args, **meta)`` costs the CPU about 16 µs on our H100's host for an empty
kernel of two arguments and 26 µs for one of twelve (``lab/call_profile.py``):
Triton binds the arguments to the signature, works out how each one specializes the kernel
(dtype, 16-byte alignment, integers equal to 1 or divisible by 16), hashes that into a cache
key and looks the compiled kernel up, every call. The launch itself, a call of the compiled
kernel's C launcher, takes 5 to 8 µs.

``lean(kernel)`` wraps a ``@triton.jit`` or ``@triton.autotune`` kernel with the same
``kernel[grid](*args, **meta)`` call. The first call with a new *launch key* goes through
Triton as usual; later calls with the same key call the compiled kernel's launcher directly.
The launch key holds everything Triton specializes on, computed more cheaply: each tensor's
dtype and whether its address is a multiple of 16, each integer's value (for a
``do_not_specialize`` integer, such as a seed, only its width), the constexprs and launch
options, and the device. It is finer than Triton's own key, so a kernel that Triton would
compile differently is never reused; an autotuned kernel's shape key is among the integers.

A host tensor descriptor (``triton.tools.tensor_descriptor.TensorDescriptor``, chapter 11's
attention) specializes the kernel by its tensor's dtype, its block shape, its padding and its
tf32 rounding: those are its part of the key (its shape and strides are runtime values).

A kernel under ``@triton.heuristics`` (chapter 04's matmul, for ``EVEN_K``) has its rules
evaluated at the first launch of a key, on the arguments, the constexprs and the autotuner's
choice, and the values kept with the launcher: a rule that reads only those gives the same value
for every call with that key. A rule that reads a tensor (whose shape is not in the key) keeps
the kernel on Triton's path for that key.

Triton's own path is kept where the shortcut would change behavior: under the interpreter,
inside ``torch.compile`` (which traces the kernel, through ``wrap_triton``), when a launch hook is set
(Proton, the profiler), for autotuners with pre-hooks, and for calls that pass a runtime
argument by keyword. Chapter 08 measures what this saves.

An operation can go further and skip the key itself for a call it has seen: within
``recorded_launches()`` every lean launch is recorded, and ``LeanKernel.bound`` turns a
recorded launch into a function of its leading tensors alone, with the grid, the integers and
the constexprs bound as they were. The operation keeps it under what its own call's key holds
(its inputs' shapes, strides, dtypes, devices and alignments: everything the launch read),
in a cache that ``plan_cache`` makes and ``LeanKernel.forget`` empties, and uses it only while
``lean_now()``: no launch hook, lean launches on.
"""

from __future__ import annotations

import contextlib

from stepkernels.runtime.core import INTERPRET
import torch

_INT32 = range(-(2**31), 2**31)
_UINT32 = range(2**32)
_INT64 = range(-(2**63), 2**63)
PLAIN = frozenset((int, float, bool, str, type(None)))  # arguments that key as they are
MAX_ENTRIES = 4096  # launch keys kept per kernel; the cache starts over beyond


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: the ceiling of a / b. Triton's (a
    ``constexpr_function`` since 3.5) costs about 3 µs a call on the host; this, 0.05."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (n >= 0), as plain arithmetic."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def hooked(hook) -> bool:
    """Is a launch hook set? Triton 3.6 keeps a chain of them, maybe empty; older ones None."""
    return hook is not None and getattr(hook, "calls", True) != []


def _width(value: int) -> int:
    """The integer type Triton passes a value as: i32, u32, i64 or u64."""
    if value in _INT32:
        return 0
    return 1 if value in _UINT32 else 2 if value in _INT64 else 3


class LeanKernel:
    """A Triton kernel launched as ``kernel[grid](*args, **meta)``, cheaply when repeated."""

    def __init__(self, kernel):
        import triton
        from triton.tools.tensor_descriptor import TensorDescriptor

        self.descriptor = TensorDescriptor

        self.kernel = kernel  # what Triton made: a JITFunction or an Autotuner
        self.entries: dict = {}
        self.runtime = None  # Triton's driver and knobs, bound at the first launch
        self.always_slow = INTERPRET  # the interpreter's kernels are Python functions
        self.unspecialized: set = set()
        self.heuristics: dict = {}  # the rules of @triton.heuristics layers
        tuned = kernel if isinstance(kernel, triton.runtime.Autotuner) else None
        self.tuned = tuned
        if INTERPRET:
            return
        jit = kernel
        while not isinstance(jit, triton.runtime.JITFunction):
            if isinstance(jit, triton.runtime.Heuristics):
                # outer layers first, as Triton runs them
                self.heuristics.update(jit.values)
            jit = jit.fn
        self.arg_names = list(jit.arg_names)
        signature = jit.signature.parameters.values()
        self.defaults = {
            p.name: p.default for p in signature if p.default is not p.empty
        }
        self.constexprs = {p.name for p in jit.params if p.is_constexpr}
        self.unspecialized = {
            index for index, p in enumerate(jit.params) if p.do_not_specialize
        }
        hooks = tuned is not None and (
            tuned.user_defined_pre_hook
            or any(c.pre_hook is not None for c in tuned.configs)
        )
        self.always_slow = hooks

    def forget(self):
        """Drop the launchers kept here and, for an autotuned kernel, its choices: the next
        call with any key tunes (if autotuned) and goes through Triton again."""
        self.entries.clear()
        for plans in PLAN_CACHES:  # the operations' bound launches: made again
            plans.clear()
        if self.tuned is not None:
            self.tuned.cache.clear()

    def __getattr__(self, name):
        """The wrapped kernel's attributes (``fn``, ``cache``, ``best_config``...)."""
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        if torch.compiler.is_compiling() and not INTERPRET:  # the compiler traces it
            return torch.library.wrap_triton(self.kernel)[grid]
        if self.always_slow or not ENABLED[0]:
            return lambda *args, **meta: self.slow_launch(grid, args, meta)
        if RECORDING:  # recorded_launches()
            return lambda *args, **meta: self.recorded_launch(grid, args, meta)
        return lambda *args, **meta: self.launch(grid, args, meta)

    def recorded_launch(self, grid, args, meta):
        compiled = self.launch(grid, args, meta)
        for launches in RECORDING:  # nested blocks: the outer ones record it too
            launches.append((self, grid, args, meta))
        return compiled

    def bound(self, grid, args: tuple, meta: dict):
        """This launch again as a function of its leading tensors, everything else bound as
        it was: grid, integers, constexprs, compiled kernel; where the launch took a host
        tensor descriptor, the function takes its tensor and describes it as it was (shape,
        strides, block shape: the same for every call of the operation's key). None where
        the launch has no lean entry or takes a tensor after another argument."""
        current_device, current_stream, _ = self.runtime or self.bind_runtime()
        device = current_device()
        try:
            entry = self.entries.get(self.key(args, meta, device))
        except RuntimeError:  # a traced tensor
            return None
        tensors = (torch.Tensor, self.descriptor)
        leading = next(
            (i for i, a in enumerate(args) if not isinstance(a, tensors)), len(args)
        )
        rest = args[leading:]
        if entry is None or any(type(a) not in PLAIN for a in rest):
            return None
        compiled, tail, cached_grid = entry
        grid_x, grid_y, grid_z = (*(cached_grid or grid), 1, 1)[:3]
        run, head = compiled.run, (compiled.function, compiled.packed_metadata)
        rest = (*rest, *tail)
        kind = self.descriptor
        templates = [  # a descriptor's fields but its tensor
            {k: v for k, v in vars(a).items() if k != "base"}
            if isinstance(a, kind)
            else None
            for a in args[:leading]
        ]

        def launch(*tensors):
            stream = current_stream(device)
            run(
                grid_x, grid_y, grid_z, stream, *head, None, None, None, *tensors, *rest
            )

        if not any(templates):
            return launch
        new = object.__new__

        def launch_described(*tensors):
            described = []
            for tensor, template in zip(tensors, templates, strict=True):
                if template is not None:  # a new descriptor, unchecked: as it was
                    descriptor = new(kind)
                    descriptor.__dict__ = {**template, "base": tensor}
                    tensor = descriptor
                described.append(tensor)
            launch(*described)

        return launch_described

    def slow_launch(self, grid, args: tuple, meta: dict):
        """Triton's own launch; for the tensors without data that a ``triton_op`` is traced
        with for ``torch.compile``, the kernel as the compiler sees it."""
        traced = [a for a in args if isinstance(a, torch.Tensor) and not has_data(a)]
        if not traced:
            return self.kernel[grid](*args, **meta)
        if not INTERPRET:
            return torch.library.wrap_triton(self.kernel)[grid](*args, **meta)
        # Under the interpreter wrap_triton hands the kernel back as it is: fake tensors
        # (shape propagation) need no launch, but no graph can hold the kernel.
        functional = torch._subclasses.functional_tensor.FunctionalTensor
        if any(isinstance(a, functional) for a in traced):
            raise RuntimeError(
                "torch.compile cannot trace an interpreted Triton kernel into its graph "
                "(TRITON_INTERPRET=1): compile on a GPU, or keep our operators opaque "
                "with torch._functorch.config.patch(decompose_custom_triton_ops=False)"
            )
        return None

    def key(self, args: tuple, meta: dict, device: int) -> tuple:
        # Integers, None, bools and floats as they are (a float is never specialized on,
        # so keying on its value costs only cache entries).
        # A fake tensor's address reads 0: no_data raises for it (a triton_op traced).
        spec = [
            a
            if type(a) in PLAIN  # most arguments: no isinstance calls
            else (a.dtype, (a.data_ptr() or no_data(a)) & 15 == 0)
            if isinstance(a, torch.Tensor)
            else self.described(a)
            if isinstance(a, self.descriptor)
            else a
            for a in args
        ]
        for index in self.unspecialized:  # a seed: only its width matters
            if type(spec[index]) is int:
                spec[index] = ("width", _width(spec[index]))
        return device, *spec, *meta.items()

    @staticmethod
    def described(descriptor) -> tuple:
        """What a host tensor descriptor specializes the kernel on."""
        padding = getattr(descriptor, "padding", None)
        tf32 = getattr(descriptor, "round_f32_to_tf32", None)  # not in Triton 3.6
        return descriptor.base.dtype, tuple(descriptor.block_shape), padding, tf32

    def launch(self, grid, args: tuple, meta: dict):
        runtime = self.runtime or self.bind_runtime()
        current_device, current_stream, knobs = runtime
        if hooked(knobs.launch_enter_hook) or hooked(knobs.launch_exit_hook):
            return self.kernel[grid](*args, **meta)
        device = current_device()
        try:
            key = self.key(args, meta, device)
        except RuntimeError:  # tensors without data: traced (torch.library.triton_op)
            return torch.library.wrap_triton(self.kernel)[grid](*args, **meta)
        entry = self.entries.get(key)
        if entry is None:
            return self.first_launch(key, grid, args, meta)
        compiled, tail, cached_grid = entry
        grid = cached_grid or grid
        stream = current_stream(device)
        compiled.run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *tail,
        )
        return compiled

    def bind_runtime(self):
        import triton
        from triton.runtime.driver import driver

        active = driver.active
        knobs = triton.knobs.runtime
        self.runtime = (active.get_current_device, active.get_current_stream, knobs)
        return self.runtime

    def first_launch(self, key, grid, args, meta):
        """Triton's own launch; remember what it compiled, unless the call cannot repeat
        cheaply (a runtime argument passed by keyword)."""
        compiled = self.kernel[grid](*args, **meta)
        if hasattr(compiled, "result"):  # Triton's asynchronous compilation
            compiled = compiled.result()
        names = self.arg_names[len(args) :]  # the parameters not passed by position
        by_keyword = [n for n in names if n in meta and n not in self.constexprs]
        if compiled is None or by_keyword:
            return compiled
        chosen = {**meta, **(self.tuned.best_config.all_kwargs() if self.tuned else {})}
        if self.heuristics:
            ruled = self.heuristic_values(args, chosen)
            if ruled is None:  # a rule read a tensor: keep Triton's path
                return compiled
            chosen.update(ruled)
        # A runtime argument left to its default: keep Triton's path.
        if any(n not in chosen and n not in self.defaults for n in names):
            return compiled
        tail = tuple(chosen[n] if n in chosen else self.defaults[n] for n in names)
        cached_grid = None
        if callable(grid):  # its inputs (shapes, chosen constexprs) are all in the key
            cached_grid = tuple(
                grid({**dict(zip(self.arg_names, args, strict=False)), **chosen})
            )
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = (compiled, tail, cached_grid)
        return compiled

    def heuristic_values(self, args: tuple, chosen: dict) -> dict | None:
        """The values ``@triton.heuristics`` rules give this call, as Triton works them out,
        or None if a rule reads a tensor argument (not all of which is in the launch key)."""
        named = _KeyedArguments(
            {**dict(zip(self.arg_names, args, strict=False)), **chosen}
        )
        try:
            for name, rule in self.heuristics.items():
                named[name] = rule(named)
        except _TensorRead:
            return None
        return {name: named[name] for name in self.heuristics}


def has_data(tensor: torch.Tensor) -> bool:
    """Does ``tensor`` hold memory a kernel can read (not a fake or functional tensor)?"""
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(tensor) and not torch._is_functional_tensor(tensor)


def concrete(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed with int sizes. A ``triton_op`` traced with symbolic shapes
    (``dynamic=True``) then specializes on them: its launch rules, cached by shape, choose a
    kernel per shape as in eager calls."""
    if all(type(n) is int for n in tensor.shape):
        return tensor
    return tensor.view(*(int(n) for n in tensor.shape))


def no_data(tensor: torch.Tensor) -> int:
    """The address 0 of an empty tensor; for a fake one (traced), a RuntimeError."""
    if has_data(tensor):
        return 0
    raise RuntimeError("a tensor without data: traced, not launched")


class _TensorRead(Exception):
    pass


class _KeyedArguments(dict):
    """A kernel's arguments by name, refusing to hand a heuristic rule a tensor."""

    def __getitem__(self, name):
        value = super().__getitem__(name)
        if isinstance(value, torch.Tensor):
            raise _TensorRead(name)
        return value

    def get(self, name, default=None):
        return self[name] if name in self else default


ENABLED = [True]
RECORDING: list = []  # the lists recorded_launches() fills, innermost last
PLAN_CACHES: list = []  # every plan_cache(), emptied by LeanKernel.forget
KNOBS = [None]  # Triton's runtime knobs, once imported


def _knobs():
    import triton

    KNOBS[0] = triton.knobs.runtime
    return KNOBS[0]


@contextlib.contextmanager
def recorded_launches(record: bool = True):
    """Within this block every lean launch is recorded in the list yielded, as (kernel,
    grid, args, meta), also where a block within it records it; those that Triton's own
    path takes (the interpreter's, inside ``triton_launches()``) are not. ``record``
    False: nothing is."""
    launches: list = []
    if not record:
        yield launches
        return
    RECORDING.append(launches)
    try:
        yield launches
    finally:  # this very list (another thread's may be equal to it)
        del RECORDING[next(i for i, r in enumerate(RECORDING) if r is launches)]


def address(t) -> int | None:
    """Where a tensor's data starts, or a host tensor descriptor's tensor's; else None."""
    t = getattr(t, "base", t)  # a descriptor's tensor
    return t.data_ptr() if isinstance(t, torch.Tensor) else None


def bound_launches(launches: list, *tensors: tuple) -> list | None:
    """The launches recorded (``recorded_launches``) as bound functions
    (``LeanKernel.bound``), if they were one a tuple of ``tensors`` and each led with exactly
    those tensors, or descriptors of them (no copy made between); else None."""
    if len(launches) != len(tensors):
        return None
    bound = []
    for (kernel, grid, args, meta), expected in zip(launches, tensors, strict=True):
        leading = args[: len(expected)]
        if len(args) > len(expected) and address(args[len(expected)]) is not None:
            return None
        if [address(t) for t in leading] != [t.data_ptr() for t in expected]:
            return None
        bound.append(kernel.bound(grid, args, meta))
    return None if None in bound else bound


class Plans(dict):
    """An operation's bound launches by its calls' keys: emptied with any kernel's
    launchers, and when full (``MAX_ENTRIES``), as a kernel's launch keys are."""

    def __setitem__(self, key, value):
        if len(self) >= MAX_ENTRIES:
            self.clear()
        super().__setitem__(key, value)


def plan_cache() -> Plans:
    """A cache for an operation's bound launches (``Plans``)."""
    plans = Plans()
    PLAN_CACHES.append(plans)
    return plans


def layout(t) -> tuple | None:
    """What a launch reads of a tensor's layout, for an operation's key of bound launches:
    shape, strides, dtype, device and the alignment of its start (None for None)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


def lean_now() -> bool:
    """May an operation call a bound launch now: lean launches on, no launch hook set, and
    no launches being recorded (a bound launch is not: an operation recording its own
    launches, to bind them, calls the ones within it by key)?"""
    if not ENABLED[0] or INTERPRET or RECORDING:
        return False
    knobs = KNOBS[0] or _knobs()
    return not (hooked(knobs.launch_enter_hook) or hooked(knobs.launch_exit_hook))


@contextlib.contextmanager
def triton_launches():
    """Within this block every lean kernel launches through Triton's own path, to measure
    what the shortcut saves (chapter 08)."""
    ENABLED[0] = False
    try:
        yield
    finally:
        ENABLED[0] = True


def lean(kernel) -> LeanKernel:
    """``kernel`` (``@triton.jit`` or ``@triton.autotune``) with cheap repeated launches."""
    return LeanKernel(kernel)
