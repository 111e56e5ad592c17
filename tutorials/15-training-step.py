r"""
The training step outside the products
======================================

We profile one training step of chapter 12's GPT, find what runs between its matrix
products, and fuse two parts of it: the optimizer, AdamW over every parameter in one
launch per group, and the residual addition with the layer norm that follows it. What
you will learn:

* reading a profile of a whole step: kernels by total time, launches per step, shares;
* how many bytes the optimizer and the residual stream move, and what that costs at the
  GPU's bandwidth;
* one elementwise kernel over many tensors: a table of their addresses, read on the GPU,
  kept right for the gradients autograd allocates and for a CUDA graph's replays;
* a forward that writes two outputs, and a backward that takes two incoming gradients.

Prerequisites: chapters 03 (layer norm), 08 (CUDA graphs) and 12 (the GPT and its
training command). Without a GPU every cell runs under Triton's interpreter, at toy
sizes.
"""

# %%
# Setup
# -----

import csv
import math

from stepkernels.lessons import bench, tutorial
from stepkernels.models.config import Config
from stepkernels.models.gpt import GPT, GPTConfig, TritonLayers, split_heads
import torch
import triton
import triton.language as tl

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# Where a step's time goes
# ------------------------
# Chapter 12 raced whole training steps: replayed from a CUDA graph, our layers and
# PyTorch's ran within a few per cent of each other, and a step made of its matrix
# products alone would run several times faster than either. The rest of the step is
# everything between the products: attention over 256 tokens with heads of 64 values,
# the layer norms, the residual additions, GELU and dropout, the loss over 84
# characters, and the optimizer.
#
# ``lab/step_profile.py`` runs one training step of the Shakespeare model (and of GPT-2
# small's shape) under ``torch.profiler``, for PyTorch's layers and ours, eager and
# replayed from a CUDA graph. It groups the GPU's kernels by name and prints the 25 that
# take the most time, with how many run a step and their share of the step; it writes
# the same table as a CSV, which the cell below shows when one is recorded for this
# GPU::
#
#     python lab/step_profile.py --shape shakespeare --shape gpt2-small
#
# Under the interpreter the profile runs at a toy size and records CPU operators instead
# of kernels (``tests/test_step_profile.py`` runs it so): it checks the script, not the
# GPU.

PROFILE = "training-step-profile.csv"


def show_profile(path, provider, rows=12):
    """The top ``rows`` kernel groups of ``provider`` in a recorded profile."""
    with open(path) as f:
        table = [r for r in csv.DictReader(f) if r["provider"] == provider]
    for shape in dict.fromkeys(r["shape"] for r in table):
        lines = [r for r in table if r["shape"] == shape][:rows]
        head = lines[0]
        print(
            f"{provider}, {shape}: {float(head['step_ms']):.2f} ms a step, "
            f"{float(head['kernels_per_step']):.0f} kernels"
        )
        for r in lines:
            print(
                f"  {float(r['share_of_step']):6.1%} {float(r['count_per_step']):5.0f}x "
                f"{r['kernel'][:70]}"
            )


recorded = bench.recorded_gpu_dir(holding=PROFILE)
if recorded is not None:
    for provider in ("triton + CUDA graph", "torch + CUDA graph"):
        show_profile(recorded / PROFILE, provider)
else:
    print(f"No {PROFILE} recorded yet: run lab/step_profile.py on a GPU.")

# %%
# The arithmetic says what two of these parts can win. AdamW reads a parameter, its
# gradient and two moments and writes three back: 28 bytes a parameter in fp32. The
# residual stream (M = B × T rows of C fp32 values) is added to twice a block and each
# sum normalized: apart, 5 passes over M × C forward (the add reads two and writes one,
# the norm reads and writes) and 6 backward (autograd adds the norm's gradient to the
# stream's in a kernel of its own); fused, 4 and 4.


def bytes_outside(cfg: Config, vocab_size: int) -> dict:
    """Bytes a training step moves for the optimizer and for the residual additions."""
    with torch.device("meta"):
        model = GPT(cfg.model_config(vocab_size))
    parameters = sum(p.numel() for p in model.parameters())
    stream = cfg.batch_size * cfg.block_size * cfg.n_embd * 4  # M x C in fp32
    additions = 2 * cfg.n_layer
    return {
        "AdamW": 28 * parameters,
        "residual additions and norms, apart": additions * (5 + 6) * stream,
        "residual additions and norms, fused": additions * (4 + 4) * stream,
    }


# The copy bandwidth and a step of ours replayed from a graph, as chapter 12's race
# recorded them (the newest recording).
shakespeare = Config(use_triton=False)
race = bench.load_recorded("gpt-training-throughput")
if race is not None:
    gpu, bandwidth = race[1]["gpu"], race[1]["limits"]["GB/s"] * 1e9
    rates = {point.provider: point.value for point in race[0]}
    step_s = (
        shakespeare.batch_size * shakespeare.block_size / rates["triton + CUDA graph"]
    )
    copies = f"copies at {bandwidth / 1e12:.1f} TB/s"
    print(f"recorded on {gpu}: a step {step_s * 1e6:,.0f} µs, {copies}")
    for name, count in bytes_outside(shakespeare, 84).items():
        at = count / bandwidth
        print(f"{name}: {count / 1e6:,.0f} MB, {at * 1e6:,.0f} µs ({at / step_s:.1%})")

# %%
# Each part is a few per cent of a step at most; what fusion also saves is launches (every
# addition is a kernel, forward and backward). The profile shows where the rest goes.
#
# AdamW, one kernel a group
# -------------------------
# For each parameter p with gradient g, moments m and v, learning rate lr, decay λ and
# step t:
#
#     p ← p (1 − lr λ)
#     m ← β₁ m + (1 − β₁) g,   v ← β₂ v + (1 − β₂) g²
#     p ← p − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)
#
# Every element is independent: it is chapter 01's vector addition with four inputs. The
# question is how one launch finds elements that live in 26 tensors scattered in memory.
# The moments are ours: we keep each group's in two flat fp32 buffers, and each
# parameter's moments are views of them. The parameters and their gradients are not:
# making them views of flat buffers too (``p.data = view``) would need gradients that
# stay allocated (autograd would add each new gradient into them, a kernel a parameter).
# So the kernel reads a table: a row per tensor with the addresses of the parameter and
# its gradient, where its moments start, its length and its first block, and a second
# table that maps each program to its tensor. A program loads its row, turns the two
# addresses into pointers (``.to(tl.pointer_type(tl.float32))``, as Triton's
# grouped-GEMM tutorial does) and updates one block of 1,024 elements of one tensor.
#
# The learning rate is read from a tensor and the step count lives on the GPU, so that a
# CUDA graph of the step replays a new rate and a new t at each step.


# %%
# @save ops/adamw
from stepkernels.runtime.core import DEVICE, INTERPRET, check_tensor
from stepkernels.runtime.launch import lean  # cheap repeated launches: chapter 08
from stepkernels.runtime.rows import quiet
import torch
import triton
import triton.language as tl

COLUMNS = 5  # a tensor's row: parameter address, gradient address, start, numel, block


@lean
@triton.jit
def adamw_kernel(
    tensors_ptr,  # int64 rows of COLUMNS, one per parameter (a gradient address 0: none)
    block_tensor_ptr,  # int32, per program: the row of the tensor its block belongs to
    exp_avg_ptr,  # the group's first moments m, fp32, flat
    exp_avg_sq_ptr,  # its second moments v
    lr_ptr,  # the learning rate, a tensor a CUDA graph's replays read afresh
    step_ptr,  # the step number t, already counted for this step
    grad_scale_ptr,  # UNSCALE: the loss scale s the gradients still carry
    found_inf_ptr,  # SKIP_ON_INF: nonzero if a gradient overflowed (fp16 loss scaling)
    lr_value,  # the learning rate when it is a number (LR_IN_TENSOR False)
    norm_ptr,  # the gradients' total norm (CLIP): clip_grad_norm_'s, done in the update
    max_norm,
    beta1,
    beta2,
    eps,
    weight_decay,
    LR_IN_TENSOR: tl.constexpr,
    UNSCALE: tl.constexpr,
    SKIP_ON_INF: tl.constexpr,
    CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    program_id = tl.program_id(axis=0)
    row = (
        tensors_ptr + tl.load(block_tensor_ptr + program_id).to(tl.int64) * 5
    )  # COLUMNS
    param_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    grad_address = tl.load(row + 1)
    grad_ptr = grad_address.to(tl.pointer_type(tl.float32))
    start, numel, first_block = tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    offsets = (program_id - first_block) * BLOCK + tl.arange(0, BLOCK)
    end = tl.where(grad_address != 0, numel, 0)  # no gradient: left alone
    if SKIP_ON_INF:  # an overflow anywhere: the whole step is skipped, on the device
        end = tl.where(tl.load(found_inf_ptr) == 0, end, 0)
    mask = offsets < end
    lr = tl.load(lr_ptr).to(tl.float32) if LR_IN_TENSOR else lr_value
    step = tl.load(step_ptr)
    # 1 - beta**t, with beta**t as 2**(t log2 beta): a scalar per program
    correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    param = tl.load(param_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask)
    if UNSCALE:  # g / s, stored back as PyTorch's fused AdamW leaves its gradients
        grad = grad / tl.load(grad_scale_ptr)
        tl.store(grad_ptr + offsets, grad, mask=mask)
    if CLIP:  # g scaled as clip_grad_norm_ scales it (the unscaled g), here as read
        grad *= tl.minimum(max_norm / (tl.load(norm_ptr) + 1e-6), 1.0)
    exp_avg = tl.load(exp_avg_ptr + start + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + start + offsets, mask=mask)
    param = param * (1.0 - lr * weight_decay)  # decoupled weight decay, first
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denominator = tl.sqrt(exp_avg_sq) / tl.sqrt(correction2) + eps
    param -= (lr / correction1) * exp_avg / denominator
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + start + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + start + offsets, exp_avg_sq, mask=mask)


@lean
@triton.jit
def grad_squares_kernel(
    tensors_ptr, block_tensor_ptr, partial_ptr, BLOCK: tl.constexpr
):
    """Each program's sum of g² over its block, through adamw_kernel's tables."""
    program_id = tl.program_id(axis=0)
    row = tensors_ptr + tl.load(block_tensor_ptr + program_id).to(tl.int64) * 5
    grad_address, numel, first_block = (
        tl.load(row + 1),
        tl.load(row + 3),
        tl.load(row + 4),
    )
    offsets = (program_id - first_block) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < tl.where(grad_address != 0, numel, 0)
    grad_ptr = grad_address.to(tl.pointer_type(tl.float32))
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
    tl.store(partial_ptr + program_id, tl.sum(grad * grad, axis=0))


@lean
@triton.jit
def norm_kernel(partial_ptr, n_partials, norm_ptr, BLOCK: tl.constexpr):
    """One program: the square root of the sum of ``n_partials`` partial sums."""
    total = tl.zeros([BLOCK], tl.float32)
    for first in tl.range(0, n_partials, BLOCK):
        slots = first + tl.arange(0, BLOCK)
        total += tl.load(partial_ptr + slots, mask=slots < n_partials, other=0.0)
    tl.store(norm_ptr, tl.sqrt(tl.sum(total, axis=0)))


# %%
# The wrapper launches the kernel over one group: blocks of 1,024 elements and 4 warps,
# so each thread holds 8 values of each of the four streams; no block spans two tensors,
# and the Shakespeare model's 10.7M parameters make a grid of about 10,500 programs,
# many per SM.

# @save ops/adamw
ADAMW_BLOCK, ADAMW_WARPS = 1024, 4


def adamw_update(
    tables,
    moments,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    grad_scale=None,
    found_inf=None,
    clip=None,
):
    """One AdamW step over a group: ``tables`` = (its tensors' rows, each program's row),
    ``moments`` = its flat (exp_avg, exp_avg_sq); ``step``: one fp32 value, this step's t.
    ``grad_scale``: one float, the scale the gradients carry (they are divided by it);
    ``found_inf``: one float, the step changes nothing where it is not 0; ``clip``: (the
    gradients' total norm, a one-value tensor, and the largest allowed)."""
    tensors, block_tensor = tables
    if block_tensor.numel() == 0:
        return
    in_tensor = isinstance(lr, torch.Tensor)
    on_device = {"lr": lr if in_tensor else None}
    on_device.update(grad_scale=grad_scale, found_inf=found_inf)
    for name, value in on_device.items():
        if value is not None and value.device != tensors.device:
            raise ValueError(
                f"{name} is a tensor on {value.device}, the parameters on "
                f"{tensors.device}: make it on theirs, .to('{tensors.device}')"
            )
    with quiet():  # the interpreter's numpy warns at log2(0), for beta = 0
        adamw_kernel[(block_tensor.numel(),)](
            tensors,
            block_tensor,
            *moments,
            lr if in_tensor else step,  # the pointers not read: any tensor
            step,
            step if grad_scale is None else grad_scale,
            step if found_inf is None else found_inf,
            0.0 if in_tensor else float(lr),
            step if clip is None else clip[0],  # not read without CLIP
            1.0 if clip is None else clip[1],
            beta1,
            beta2,
            eps,
            weight_decay,
            LR_IN_TENSOR=in_tensor,
            UNSCALE=grad_scale is not None,
            SKIP_ON_INF=found_inf is not None,
            CLIP=clip is not None,
            BLOCK=ADAMW_BLOCK,
            num_warps=ADAMW_WARPS,
        )


# %%
# The optimizer is a ``torch.optim.Optimizer``: its parameter groups, learning rates and
# ``state`` (``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter, as PyTorch's AdamW
# keeps them) are the usual ones, so the training command saves and resumes it as it
# does PyTorch's, and a checkpoint of either optimizer loads into the other. The
# addresses in the table are written from the CPU, and only when they change: gradients
# that autograd allocates anew at each step (``zero_grad`` sets them to None) often come
# back at the same addresses. Under CUDA-graph capture the copy is always recorded, from
# pinned memory the optimizer keeps, so that every replay writes the addresses of the
# graph's own gradients.
#
# In fp16 (the training command's dtype on a GPU without bf16: a T4, a V100), gradients
# below 6e-8 flush to zero, so ``torch.amp.GradScaler`` scales the loss by s and checks
# the gradients for inf and nan. With an optimizer that cannot take that check, the
# scaler reads its flag on the CPU: a synchronization a CUDA graph cannot hold. Ours takes
# the scale and the flag as tensors (``_step_supports_amp_scaling``), as PyTorch's fused
# AdamW does: the kernel divides g by s, stores nothing where the flag is set, and the
# step count grows by ``found_inf == 0``; without a scaler both branches compile out.


# @save ops/adamw
def adamw_arguments(lr, betas, eps, weight_decay):
    """Refuse what torch.optim.AdamW refuses, and a rate in a tensor not of one float."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise TypeError(
                f"lr as a tensor must hold one float, got {tuple(lr.shape)} {lr.dtype}"
            )
        return adamw_arguments(0.0, betas, eps, weight_decay)
    numbers = {"lr": lr, "eps": eps, "weight_decay": weight_decay}
    if len(betas) == 2:
        numbers.update(beta1=betas[0], beta2=betas[1])
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    for name in ("lr", "eps", "weight_decay"):
        if not numbers[name] >= 0:  # nan too
            raise ValueError(f"{name} must be >= 0, got {numbers[name]!r}")
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")


class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` as one kernel launch per parameter group (and one that counts
    the steps of all groups), with the learning rate a number or a one-element tensor, which
    a CUDA graph of the step reads afresh at every replay (as ``capturable=True`` does for
    PyTorch's). Parameters: fp32, contiguous, a group's on one device. The state dict is
    that of ``torch.optim.AdamW``: a checkpoint of either loads into the other.

    One step count per group: a parameter without a gradient is left as it is (as
    PyTorch's does), but its group's count goes on, where PyTorch's keeps one per
    parameter.

    With ``torch.amp.GradScaler`` (fp16 training), ``scaler.step(optimizer)`` sets the
    tensors ``grad_scale`` (None once ``scaler.unscale_`` ran) and ``found_inf`` on the
    optimizer: the kernel divides the gradients by the scale and leaves everything,
    step count included, as it was where a gradient overflowed, all on the device, so
    that a CUDA graph of the step holds the scaler too."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2
    ):
        adamw_arguments(lr, betas, eps, weight_decay)
        self.moments = []  # per group: flat (exp_avg, exp_avg_sq)
        self.tables = []  # per group: [rows of its tensors, each program's row]
        self.fixed = []  # per group: the rows' columns that never change, on the CPU
        self.addresses = []  # per group: the addresses its table holds now
        self.spares = []  # per group: pinned host rows for the next CUDA-graph capture
        self.pinned = []  # host rows that recorded graphs read at each replay: kept
        self.steps = None  # one fp32 step count per group, on the parameters' device
        self.written = set()  # groups whose table was written for the coming step
        self.clip = None  # (total norm, max_norm) for the coming step: clip_grad_norm
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        for p in params:
            check_tensor(p, "a parameter", (torch.float32,), contiguous=True)
        device = params[0].device if params else DEVICE
        if any(p.device != device for p in params):
            raise ValueError(f"a group's parameters must share one device, {device}")
        sizes = torch.tensor([p.numel() for p in params], dtype=torch.int64)
        blocks = (sizes + ADAMW_BLOCK - 1) // ADAMW_BLOCK
        rows = torch.zeros(len(params), COLUMNS, dtype=torch.int64)
        rows[:, 2] = sizes.cumsum(0) - sizes  # where each tensor's moments start
        rows[:, 3] = sizes
        rows[:, 4] = blocks.cumsum(0) - blocks  # its first program
        block_tensor = torch.arange(len(params)).repeat_interleave(blocks)
        self.tables.append([rows.to(device), block_tensor.to(device, torch.int32)])
        self.fixed.append(rows)
        self.spares.append(rows.pin_memory() if device.type == "cuda" else None)
        self.addresses.append(None)
        total = int(sizes.sum())
        self.moments.append([torch.zeros(total, device=device) for _ in range(2)])
        index = len(self.moments) - 1
        steps = torch.zeros(len(self.moments), device=device)
        if self.steps is not None:
            steps[:index] = self.steps
        self.steps = steps
        for group in range(len(self.moments)):  # the new step tensor, in every state
            self.link_state(group)

    def views(self, index):
        """(parameter, its exp_avg view, its exp_avg_sq view) for group ``index``."""
        start = 0
        for p in self.param_groups[index]["params"]:
            end = start + p.numel()
            yield p, *(flat[start:end].view_as(p) for flat in self.moments[index])
            start = end

    def link_state(self, index):
        """Each parameter's state as PyTorch's AdamW names it: views, and the group's step."""
        for p, exp_avg, exp_avg_sq in self.views(index):
            self.state[p] = dict(
                step=self.steps[index], exp_avg=exp_avg, exp_avg_sq=exp_avg_sq
            )

    def write_addresses(self, index):
        """Point group ``index``'s table at its parameters and their gradients."""
        addresses = []
        for p in self.param_groups[index]["params"]:
            grad = p.grad
            if grad is not None and (grad.shape != p.shape or not grad.is_contiguous()):
                raise ValueError(
                    f"a gradient of shape {tuple(grad.shape)}, strides {grad.stride()} "
                    f"for a parameter of shape {tuple(p.shape)}: FusedAdamW reads "
                    "contiguous gradients of the parameter's shape"
                )
            addresses.append((p.data_ptr(), 0 if grad is None else grad.data_ptr()))
        tensors = self.tables[index][0]
        capturing = tensors.is_cuda and torch.cuda.is_current_stream_capturing()
        if tensors.is_cuda and self.spares[index] is None and not capturing:
            # pinned outside any capture, for the next one to record its copy from
            self.spares[index] = self.fixed[index].pin_memory()
        if addresses == self.addresses[index] and not capturing:
            return
        if capturing:  # the graph reads these rows at every replay: never reused
            rows, self.spares[index] = self.spares[index], None
            if rows is None:
                raise RuntimeError(
                    "FusedAdamW: a second CUDA-graph capture without an eager step since "
                    "the last: run one step eagerly before capturing again"
                )
            self.pinned.append(rows)
        else:
            rows = self.fixed[index].clone()
            rows = rows.pin_memory() if tensors.is_cuda else rows
        rows[:, :2] = torch.tensor(addresses, dtype=torch.int64).reshape(-1, 2)
        tensors.copy_(rows, non_blocking=True)
        # A captured copy runs at the replays, not now: the next eager step writes again.
        self.addresses[index] = None if capturing else addresses

    # torch.amp.GradScaler's step() hands us its scale and overflow flag as the tensors
    # self.grad_scale and self.found_inf instead of reading the flag on the host.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaling = {
            name: getattr(self, name, None) for name in ("grad_scale", "found_inf")
        }
        for name, value in scaling.items():
            if value is not None and (
                value.numel() != 1 or value.dtype != torch.float32
            ):
                raise TypeError(
                    f"{name} must be one float32 value, as torch.amp.GradScaler's step "
                    f"sets it, got {tuple(value.shape)} {value.dtype}"
                )
        found_inf = scaling["found_inf"]
        # A skipped step is not counted, as PyTorch's fused AdamW has it: t + (found_inf == 0)
        self.steps += (
            1 if found_inf is None else (found_inf.to(self.steps) == 0).float()
        )
        for index, group in enumerate(self.param_groups):
            self.write_table(index)
            beta1, beta2 = group["betas"]
            args = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
            step = self.steps[index : index + 1]
            adamw_update(
                self.tables[index],
                self.moments[index],
                *args,
                step,
                **scaling,
                clip=self.clip,
            )
        self.written, self.clip = set(), None
        return loss

    def zero_grad(self, set_to_none=True):
        self.written, self.clip = set(), None  # new gradients: new addresses
        super().zero_grad(set_to_none)

    def write_table(self, index):
        """write_addresses once a step (a capture records one copy a group)."""
        if index not in self.written:
            self.write_addresses(index)
            self.written.add(index)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, fused: the
        gradients' total norm in one launch a group and one more, and its scale applied by
        the next ``step`` as it reads each gradient; the gradients are left as they are.
        With a GradScaler, call ``scaler.unscale_(optimizer)`` first, as for
        ``clip_grad_norm_``: the norm is of the gradients as they are now.
        Returns the total norm, a tensor on the parameters' device (no synchronization)."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"max_norm must be a number, got {max_norm!r}")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        if len({tensors.device for tensors, _ in self.tables}) > 1:
            raise ValueError("clip_grad_norm: the groups are on several devices")
        counts = [block_tensor.numel() for _, block_tensor in self.tables]
        total = sum(counts)  # programs: one partial sum each
        partials = self.steps.new_empty(total) if total else self.steps.new_zeros(1)
        first = 0
        for index, count in enumerate(counts):
            self.write_table(index)
            if count:
                tensors, block_tensor = self.tables[index]
                grad_squares_kernel[(count,)](
                    tensors, block_tensor, partials[first:], BLOCK=ADAMW_BLOCK
                )
            first += count
        norm = self.steps.new_empty(1)
        norm_kernel[(1,)](partials, partials.numel(), norm, BLOCK=1024)
        self.clip = (norm, float(max_norm))
        return norm[0]

    def state_dict(self):
        """PyTorch's AdamW's layout: each parameter's own step tensor and moments."""
        saved, index = super().state_dict(), 0
        saved["state"] = {}
        for group in range(len(self.moments)):
            for _, exp_avg, exp_avg_sq in self.views(group):
                step = self.steps[group].clone()
                entry = dict(step=step, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
                saved["state"][index] = entry
                index += 1
        return saved

    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer or of ``torch.optim.AdamW``."""
        super().load_state_dict(state_dict)  # new tensors in self.state: copied back
        for index, group in enumerate(self.param_groups):
            device = self.moments[index][0].device
            if isinstance(group["lr"], torch.Tensor):  # saved from elsewhere: the CPU's
                group["lr"] = group["lr"].to(device)
            counts = set()
            for p, exp_avg, exp_avg_sq in self.views(index):
                loaded = self.state.get(p, {})
                for name, view in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                    view.copy_(loaded[name]) if name in loaded else view.zero_()
                counts.add(float(loaded.get("step", 0)))
            if len(counts) > 1:
                raise ValueError(
                    f"parameter group {index} has parameters at different steps "
                    f"{sorted(counts)}: FusedAdamW keeps one step count a group"
                )
            self.steps[index] = counts.pop() if counts else 0.0
            self.link_state(index)


# %%
# The check runs our optimizer and ``torch.optim.AdamW(fused=True, capturable=True)``,
# the one the training command uses, side by side from the same parameters and gradients
# for five steps, with weight decay on one group, and compares the parameters and
# moments after each.


def check_adamw(shapes, steps=5, seed=0):
    """Our AdamW against PyTorch's fused one, step by step; the largest gap over all."""
    generator = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=generator).to(DEVICE) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    groups = lambda ps: [{"params": ps[::2]}, {"params": ps[1::2], "weight_decay": 0}]
    lr = torch.tensor(3e-3, device=DEVICE)
    optimizers = (
        FusedAdamW(groups(ours), lr=lr.clone(), betas=(0.9, 0.99), weight_decay=0.1),
        torch.optim.AdamW(
            groups(theirs),
            lr=lr,
            betas=(0.9, 0.99),
            weight_decay=0.1,
            fused=True,
            capturable=True,
        ),
    )
    gap = 0.0
    for _ in range(steps):
        for a, b in zip(ours, theirs, strict=True):
            g = torch.randn(a.shape, generator=generator).to(DEVICE)
            a.grad, b.grad = g.clone(), g.clone()
        for optimizer in optimizers:
            optimizer.step()
        for a, b in zip(ours, theirs, strict=True):
            mine, reference = optimizers[0].state[a], optimizers[1].state[b]
            for x, y in (
                (a, b),
                *((mine[k], reference[k]) for k in ("exp_avg", "exp_avg_sq")),
            ):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
                gap = max(gap, (x - y).abs().max().item())
    return gap


shapes = [(7, 5), (5,), (1,), (3, 2, 9), (130,)]
print(f"5 steps as torch's fused AdamW: largest difference {check_adamw(shapes):.1e}")

# %%
# The training command clips the gradients first: ``clip_grad_norm_`` launches norms per
# tensor, their norm, a scale, and a pass that multiplies every gradient by it.
# ``FusedAdamW.clip_grad_norm`` reads the same tables: one launch a group sums g² per
# block, one more adds the partial sums (in a fixed order: the same norm at every run),
# and the update scales g by min(1, max_norm / norm) as it reads it. The gradients are
# left as they are; the next step alone is clipped.

params = [torch.nn.Parameter(torch.randn(s, device=DEVICE)) for s in shapes]
copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
for p, q in zip(params, copies, strict=True):
    p.grad = torch.randn(p.shape, device=DEVICE)
    q.grad = p.grad.clone()
fused, reference = FusedAdamW(params), torch.optim.AdamW(copies)
norms = fused.clip_grad_norm(0.1), torch.nn.utils.clip_grad_norm_(copies, 0.1)
fused.step()
reference.step()
print(f"gradient norm {norms[0].item():.4f} (ours), {norms[1].item():.4f} (PyTorch's)")
for p, q in zip(params, copies, strict=True):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

# %%
# Benchmark: the optimizer step
# -----------------------------
# The step over the parameters of the Shakespeare model (10.7M) and of GPT-2 small
# (124M), shaped as the models have them, in two groups as the training command makes
# them; the gradients are set once. The bytes counted are the 28 a parameter that AdamW
# must move (ours also reads its table: 40 bytes a tensor, 4 a block). ``torch (fused)``
# is the training command's optimizer for PyTorch's layers; ``torch (foreach)``,
# PyTorch's default on a GPU.

OPTIMIZER_SIZES = bench.choose(
    gpu={
        "shakespeare": GPTConfig(84),
        "gpt2-small": GPTConfig(50304, 1024, 12, 12, 768),
    },
    cpu={"tiny": GPTConfig(84, 16, 2, 2, 32)},
)


def make_optimizer_step(provider, x, dtype):
    config = dict(enumerate(OPTIMIZER_SIZES.values()))[int(x)]
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(config).parameters()]
    params = [torch.nn.Parameter(torch.randn(s, device=DEVICE) * 0.02) for s in shapes]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    lr = torch.tensor(1e-3, device=DEVICE)
    if provider == "triton":
        optimizer = FusedAdamW(groups, lr=lr)
    elif provider == "torch (fused)":
        optimizer = torch.optim.AdamW(groups, lr=lr, fused=True, capturable=True)
    else:  # capturable foreach needs a GPU; without, the rate is a number
        capturable = tutorial.ON_GPU
        rate = lr if capturable else 1e-3
        optimizer = torch.optim.AdamW(
            groups, lr=rate, foreach=True, capturable=capturable
        )
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return optimizer.step


def optimizer_bytes(x, dtype):
    config = dict(enumerate(OPTIMIZER_SIZES.values()))[int(x)]
    with torch.device("meta"):
        return 28 * sum(p.numel() for p in GPT(config).parameters())


optimizer_step = bench.run(
    bench.Benchmark(
        name="adamw-step",
        x_name="parameters of the model",
        x_values=bench.choose(gpu=[0, 1], cpu=[0]),
        providers=["triton", "torch (fused)", "torch (foreach)"],
        make=make_optimizer_step,
        work=optimizer_bytes,
        smoke_x=0,
        headline_x=0,
        x_log2=False,
        x_labels=dict(enumerate(OPTIMIZER_SIZES)),
    )
)

# %%
# The residual addition and the norm, in one kernel
# -------------------------------------------------
# A block of chapter 12 computes ``x = x + attention(norm_1(x))``, then ``norm_2(x)``,
# and the next block starts with ``norm_1`` of ``x + mlp(...)``: every addition to the
# residual stream is followed by a layer norm of the sum. One kernel can do both: it
# reads x and the update, writes the sum h (the stream goes on) and y = layer_norm(h),
# and keeps each row's mean and 1/std for the backward. Forward, that is 2 reads and 2
# writes of M × C values where apart it was 3 and 2.
#
# Backward, h has two consumers, the norm and the rest of the stream, so its gradient is
# the sum of two: dh from the stream and chapter 03's layer-norm backward of dy. The
# backward kernel adds dh as it writes dx, and dx is the gradient of both x and the
# update (an addition passes its gradient through). Apart, that sum was another kernel
# reading two tensors and writing one. The weight's and bias's gradients are sums over
# all rows: each program adds its rows in registers and writes one partial row with
# chapter 03's ``flush_partials`` (``runtime/partials``), and one more launch sums the
# partial rows.
#
# The sum is rounded to h's dtype before the norm uses it: the norm normalizes exactly
# the h that the stream carries on, as PyTorch's two kernels do. Under autocast the
# stream is fp32 and the update bf16; h is fp32, the wider of the two, and y goes to the
# next product, which takes bf16: ``out_dtype`` has the kernel write y in bf16, rounded
# once, where PyTorch's norm writes fp32 and the product's autocast casts it (a pass
# more, forward and backward).


# %%
# @save ops/add_layer_norm
import functools
import math

from stepkernels.ops.layer_norm import layer_norm  # rows too long for one program
from stepkernels.runtime.arguments import layer_norm_arguments
from stepkernels.runtime.core import (
    INTERPRET,
    check_tensor,
    refuse_double_backward,
    sm_count,
)
from stepkernels.runtime.launch import lean
from stepkernels.runtime.partials import (  # chapter 03: dW and dB in two stages
    flush_partials,
)
from stepkernels.runtime.partials import (
    sum_partials as second_stage,
)
from stepkernels.runtime.rows import as_rows
import torch
import triton
import triton.language as tl


@lean
@triton.jit
def add_layer_norm_forward_kernel(
    x_ptr,  # the residual stream, (M, N)
    residual_ptr,  # what a layer adds to it, (M, N), maybe another dtype
    h_ptr,  # out: h = x + residual, in the wider of the two dtypes
    y_ptr,  # out: layer_norm(h), in h's dtype or the next product's (out_dtype)
    weight_ptr,
    bias_ptr,
    mean_ptr,  # out: each row's mean and 1 / std, fp32, for the backward
    rstd_ptr,
    x_row_stride,  # the inputs' rows may be strided (a slice); the outputs' are N apart
    residual_row_stride,
    M,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(axis=0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]  # row * stride can pass 2**31
    offsets = rows64 * N + cols[None, :]
    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
    residual_ptrs = residual_ptr + rows64 * residual_row_stride + cols[None, :]
    residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    h = (x + residual).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offsets, h, mask=mask)
    h = h.to(tl.float32)  # the rounded sum, as the backward will read it
    mean = tl.sum(h, axis=1) / N
    centered = tl.where(mask, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


# %%
# The backward walks its rows one at a time, as chapter 03's does, with dW and dB summed
# in registers over the rows of the program; ``HAS_DH`` is off when the sum h is not
# used further (the block's last norm, say), and then dx is the norm's gradient alone.


# @save ops/add_layer_norm
@lean
@triton.jit
def add_layer_norm_backward_kernel(
    h_ptr,  # the saved sum
    dy_ptr,  # gradient of y
    dh_ptr,  # gradient of h from its other uses (the stream goes on); HAS_DH
    dx_ptr,  # out: gradient of x and of residual, dh + layer_norm's backward of dy
    dx_low_ptr,  # out: the same in the other input's dtype (bf16 update); HAS_DX_LOW
    weight_ptr,
    mean_ptr,
    rstd_ptr,
    partial_ptr,  # out: each program's sums of dy * h_hat and dy, (programs, 2, N)
    dy_row_stride,
    dh_row_stride,
    M,
    N,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_DX_LOW: tl.constexpr,
    REDUCTION: tl.constexpr,  # "two-stage": a partial row a program (chapter 03)
):
    program_id = tl.program_id(axis=0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw, db = tl.zeros([BLOCK_N], tl.float32), tl.zeros([BLOCK_N], tl.float32)
    for i in tl.range(ROWS_PER_PROGRAM):
        row = program_id * ROWS_PER_PROGRAM + i
        mask = cols < tl.where(row < M, N, 0)
        row64 = row.to(tl.int64)
        h = tl.load(h_ptr + row64 * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row64 * dy_row_stride + cols, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        safe_row = tl.minimum(row, M - 1)  # rows past M read row M - 1, add nothing
        mean, rstd = tl.load(mean_ptr + safe_row), tl.load(rstd_ptr + safe_row)
        h_hat, wdy = (h - mean) * rstd, w * dy if HAS_WEIGHT else dy
        c1, c2 = tl.sum(h_hat * wdy, axis=0) / N, tl.sum(wdy, axis=0) / N
        dx = (wdy - (h_hat * c1 + c2)) * rstd
        if HAS_DH:
            dh = tl.load(dh_ptr + row64 * dh_row_stride + cols, mask=mask, other=0.0)
            dx += dh.to(tl.float32)
        tl.store(dx_ptr + row64 * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DX_LOW:  # rounded here, not by a cast kernel that reads dx again
            low = dx.to(dx_low_ptr.dtype.element_ty)
            tl.store(dx_low_ptr + row64 * N + cols, low, mask=mask)
        dw, db = dw + dy * h_hat, db + dy  # masked lanes: dy = 0
    slots = (program_id, program_id, 0)
    flush_partials(
        (partial_ptr, partial_ptr), (dw, db), (cols, col_mask), N, slots, REDUCTION
    )


# %%
# The launch rules follow chapter 03's for rows that fit a program (up to 8,192 columns
# here; longer ones take the sum, then chapter 03's ``layer_norm``, which splits them):
# forward tiles of 4,096 values, several short rows a program; backward, enough programs
# to fill the GPU with rows of this width, at most 64 rows each, so the partial sums
# stay small beside the stream. The function's backward receives dh and dy, either None
# when its output is unused (``set_materialize_grads(False)``), and returns dx for both
# x and the update.

# @save ops/add_layer_norm
MAX_BLOCK = 8192  # longer rows: the sum, then chapter 03's layer norm
FORWARD_TILE = 4096  # values a forward program holds: rows of up to 4,096 columns
BACKWARD_MAX_ROWS = 64


@functools.cache  # once per shape: off the call's path
def forward_config(n_cols, n_rows):
    block = triton.next_power_of_2(n_cols)
    rows = max(1, min(FORWARD_TILE // block, triton.next_power_of_2(n_rows)))
    warps = max(1, min(16, rows * block // 1024))
    return dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, num_warps=warps)


@functools.cache
def backward_config(n_cols, n_rows):
    """A row at a time, as chapter 03's backward: enough programs to fill the GPU, each
    with enough rows that the partial sums stay small beside the stream."""
    block = triton.next_power_of_2(n_cols)
    programs = 4 if INTERPRET else max(1, 4096 // block) * sm_count()
    wanted = triton.next_power_of_2(triton.cdiv(n_rows, programs))
    rows = min(BACKWARD_MAX_ROWS, wanted)
    return dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, num_warps=max(4, block // 1024))


def add_layer_norm_forward(x, residual, weight, bias, eps, out_dtype):
    """h, y, and each row's mean and 1 / std (fp32) for (M, N) rows x and residual."""
    (n_rows, n_cols), device = x.shape, x.device
    dtype = torch.promote_types(x.dtype, residual.dtype)
    h = torch.empty((n_rows, n_cols), device=device, dtype=dtype)
    y = torch.empty_like(h, dtype=out_dtype or dtype)
    mean, rstd = (torch.empty(n_rows, device=device) for _ in "mr")
    forward = forward_config(n_cols, n_rows)
    grid = (triton.cdiv(n_rows, forward["ROWS_PER_PROGRAM"]),)
    affine = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    add_layer_norm_forward_kernel[grid](
        x,
        residual,
        h,
        y,
        weight if weight is not None else h,
        bias if bias is not None else h,
        mean,
        rstd,
        x.stride(0),
        residual.stride(0),
        n_rows,
        n_cols,
        eps,
        **affine,
        **forward,
    )
    return h, y, mean, rstd


def add_layer_norm_backward(h, dy, dh, weight, mean, rstd, low_dtype=None):
    """dx in h's dtype (the gradient of x and of the update), the same in ``low_dtype``
    (an empty tensor if None), and the (2, N) fp32 sums of dW and dB; dy and dh (None:
    h not used further) as rows."""
    (n_rows, n_cols), device = h.shape, h.device
    backward = backward_config(n_cols, n_rows)
    programs = triton.cdiv(n_rows, backward["ROWS_PER_PROGRAM"])
    partials = torch.empty((programs, 2, n_cols), device=device)
    dx = torch.empty_like(h)
    dx_low = (
        h.new_empty(0) if low_dtype is None else torch.empty_like(h, dtype=low_dtype)
    )
    add_layer_norm_backward_kernel[(programs,)](
        h,
        dy,
        dh if dh is not None else dy,
        dx,
        dx if low_dtype is None else dx_low,
        weight if weight is not None else h,
        mean,
        rstd,
        partials,
        dy.stride(0),
        dy.stride(0) if dh is None else dh.stride(0),
        n_rows,
        n_cols,
        HAS_WEIGHT=weight is not None,
        HAS_DH=dh is not None,
        HAS_DX_LOW=low_dtype is not None,
        REDUCTION="two-stage",
        **backward,
    )
    return dx, dx_low, sum_partials(partials)  # (2, N): fp32, rounded once by callers


def sum_partials(partials):
    """The (2, N) sums of (programs, 2, N) partial sums by chapter 03's second stage:
    narrow column blocks, each program's share of the partials loaded in tiles."""
    n_cols = partials.shape[2]
    sums = partials.new_empty((2, n_cols))
    visits = partials  # no visit counts (HAS_COUNTS False): not read
    flags = dict(HAS_COUNTS=False, HAS_DW=True, HAS_DB=True)
    second_stage(partials, visits, *sums, n_cols, **flags)
    return sums


def low_dtype_of(h, dtypes):
    """The inputs' dtype other than h's (the update's, under autocast), else None."""
    return next((dtype for dtype in dtypes if dtype != h.dtype), None)


def input_grads(dx, dx_low, dtypes):
    """dx as the gradient of each input, in that input's dtype."""
    return tuple(
        dx if d == dx.dtype else dx_low if d == dx_low.dtype else dx.to(d)
        for d in dtypes
    )


def weight_grads(sums, h, weight, has_bias):
    """dW and dB from their fp32 sums, each rounded once; None where there is none."""
    grad_dtype = h.dtype if weight is None else weight.dtype
    dw = sums[0].to(grad_dtype) if weight is not None else None
    db = sums[1].to(grad_dtype) if has_bias else None
    return dw, db


class AddLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, out_dtype):
        h, y, mean, rstd = add_layer_norm_forward(
            x, residual, weight, bias, eps, out_dtype
        )
        if ctx is not None:
            # an unused output's gradient: None, not zeros
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(h, weight, mean, rstd)
            ctx.dtypes, ctx.has_bias = (x.dtype, residual.dtype), bias is not None
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        return add_layer_norm_grads(ctx, dh, dy, add_layer_norm_backward)


def add_layer_norm_grads(ctx, dh, dy, backward):
    """The gradients of (x, residual, weight, bias, eps, out_dtype) from those of (h, y),
    with ``backward`` the kernels' launch (eager, or the operator the compiler sees)."""
    refuse_double_backward("add_layer_norm", "torch.nn.functional.layer_norm")
    h, weight, mean, rstd = ctx.saved_tensors
    dx_dtype, residual_dtype = ctx.dtypes
    if dy is None:  # y unused: the sum's gradient passes through, none for w and b
        return dh.to(dx_dtype), dh.to(residual_dtype), None, None, None, None
    dy, dh = as_rows(dy), None if dh is None else as_rows(dh)
    low = low_dtype_of(h, ctx.dtypes)
    dx, dx_low, sums = backward(h, dy, dh, weight, mean, rstd, low)
    dw, db = weight_grads(sums, h, weight, ctx.has_bias)
    return *input_grads(dx, dx_low, ctx.dtypes), dw, db, None, None


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def add_layer_norm(
    x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, *, out_dtype=None
):
    """(h, y): h = x + residual, y = ``layer_norm(h, normalized_shape, weight, bias, eps)``,
    in one pass over memory. h's dtype is the wider of x's and residual's (fp32 for an fp32
    stream plus a bf16 update under autocast); y's is ``out_dtype``, else h's: computed in
    fp32 and rounded once, as a cast of PyTorch's fp32 norm to the next product's dtype."""
    shape = layer_norm_arguments(
        x,
        normalized_shape,
        weight,
        bias,
        eps,
        "two-stage",
        None,
        SUPPORTED_DTYPES,
        ("two-stage",),
    )
    check_tensor(residual, "residual", SUPPORTED_DTYPES)
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"out_dtype must be one of {SUPPORTED_DTYPES}, got {out_dtype!r}"
        )
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)} and device {x.device}, got "
            f"{tuple(residual.shape)} on {residual.device}: broadcast it with expand_as(x)"
        )
    n_cols = math.prod(shape)
    if n_cols > MAX_BLOCK or x.numel() == 0:  # the sum, then chapter 03's kernels
        h = x + residual
        return h, layer_norm(h, shape, weight, bias, eps).to(out_dtype or h.dtype)
    x2d, residual2d = (as_rows(t.reshape(-1, n_cols)) for t in (x, residual))
    flat = lambda p: None if p is None else p.reshape(-1).contiguous()
    args = (x2d, residual2d, flat(weight), flat(bias), float(eps), out_dtype)
    if torch.compiler.is_compiling():  # an operator the compiler traces (below)
        h, y, _, _ = add_layer_norm_forward_op(*args)
        return h.view(x.shape), y.view(x.shape)
    grads = any(t is not None and t.requires_grad for t in (x, residual, weight, bias))
    if grads and torch.is_grad_enabled():
        h, y = AddLayerNormFunction.apply(*args)
    else:
        h, y = AddLayerNormFunction.forward(None, *args)
    return h.view(x.shape), y.view(x.shape)


# %%
# Under ``torch.compile`` the same kernels are two operators of ``torch.library``, as
# chapter 03's layer norm: the compiler traces each body with its kernels (``triton_op``),
# ``register_autograd`` gives the derivative, and eager calls keep the path above.
# ``concrete`` views the rows with int sizes, so a trace with symbolic shapes specializes
# on them instead of handing the launch rules, cached by shape, a symbol.

# @save ops/add_layer_norm
from stepkernels.runtime.launch import concrete  # a kernel per shape, as in eager calls
from torch import Tensor
from torch.library import triton_op


@triton_op("stepkernels::add_layer_norm_forward", mutates_args={})
def add_layer_norm_forward_op(
    x2d: Tensor,
    residual2d: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows = (concrete(x2d), concrete(residual2d))
    return add_layer_norm_forward(
        *rows, weight, bias, eps, out_dtype
    )  # h, y, mean, rstd


@triton_op("stepkernels::add_layer_norm_backward", mutates_args={})
def add_layer_norm_backward_op(
    h: Tensor,
    dy: Tensor,
    dh: Tensor | None,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    low_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    rows = (concrete(h), concrete(dy), None if dh is None else concrete(dh))
    # dx, dx in low_dtype (or empty), the sums of dW and dB
    return add_layer_norm_backward(*rows, weight, mean, rstd, low_dtype)


def add_layer_norm_setup(ctx, inputs, output):
    x2d, residual2d, weight, bias, _, _ = inputs
    h, _, mean, rstd = output
    ctx.save_for_backward(h, weight, mean, rstd)
    ctx.dtypes, ctx.has_bias = (x2d.dtype, residual2d.dtype), bias is not None
    ctx.set_materialize_grads(False)  # as in the Function: None for an unused output


def add_layer_norm_op_backward(ctx, dh, dy, _mean_grad, _rstd_grad):
    return add_layer_norm_grads(ctx, dh, dy, add_layer_norm_backward_op)


add_layer_norm_forward_op.register_autograd(
    add_layer_norm_op_backward, setup_context=add_layer_norm_setup
)


# %%
# The check compares h, y and the four gradients (of x, of the update, dW and dB) with
# PyTorch's ``x + residual`` and ``layer_norm`` in fp64, over shapes that break naive
# kernels: one row, widths that are not powers of two, an update of another dtype, and
# inputs whose rows are strided slices. Tolerances: one rounding of the output's dtype,
# relative to the largest value.

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_add_layer_norm(cases, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rand = lambda shape, dtype: torch.randn(shape, generator=generator).to(
        DEVICE, dtype
    )
    for shape, x_dtype, residual_dtype, sliced in cases:
        columns = (shape[-1] * 2 if sliced else shape[-1],)
        inputs = [rand((*shape[:-1], *columns), x_dtype), rand(shape, residual_dtype)]
        inputs[0] = inputs[0][..., : shape[-1]] if sliced else inputs[0]
        inputs += [rand(shape[-1:], torch.float32), rand(shape[-1:], torch.float32)]
        ours = [t.detach().requires_grad_() for t in inputs]
        exact = [t.detach().double().requires_grad_() for t in inputs]
        h, y = add_layer_norm(ours[0], ours[1], shape[-1:], ours[2], ours[3])
        h_exact = exact[0] + exact[1]
        y_exact = torch.nn.functional.layer_norm(h_exact, shape[-1:], *exact[2:])
        dh, dy = rand(shape, h.dtype), rand(shape, y.dtype)
        torch.autograd.backward((h, y), (dh, dy))
        torch.autograd.backward((h_exact, y_exact), (dh.double(), dy.double()))
        got = [h, y, *(t.grad for t in ours)]
        wanted = [h_exact, y_exact, *(t.grad for t in exact)]
        for name, mine, expected in zip(
            ("h", "y", "dx", "dresidual", "dW", "dB"), got, wanted, strict=True
        ):
            tol = (
                TOLERANCE[mine.dtype]
                if name not in ("dW", "dB")
                else TOLERANCE[h.dtype]
            )
            torch.testing.assert_close(
                mine.double(),
                expected,
                rtol=tol,
                atol=tol * expected.abs().max().item(),
                msg=lambda m, where=f"{name}, {shape}, {x_dtype}": f"{where}: {m}",
            )
    print(f"h, y, dx, dresidual, dW, dB as PyTorch's in fp64: {len(cases)} cases")


check_add_layer_norm(
    [
        ((1, 384), torch.float32, torch.float32, False),
        ((3, 5, 100), torch.float32, torch.bfloat16, True),
        ((37, 768), torch.bfloat16, torch.bfloat16, False),
        ((9, 1000), torch.float16, torch.float16, True),
    ]
)

# %%
# Benchmark: residual addition and norm
# -------------------------------------
# M = 16,384 rows (a batch of the Shakespeare model: 64 × 256 tokens), C from 384 to
# 4,096, the stream and the update in fp32 (the training command's stream) and bf16,
# forward and backward timed apart as in chapter 03. The bytes counted are the fused
# kernel's: x, the update, h and y forward; h, dy, dh and dx backward.
# ``triton (apart)`` is our two calls: PyTorch's addition, then chapter 03's
# ``layer_norm``.

from stepkernels import layer_norm  # noqa: E402  (chapter 03's)

ADD_NORM_ROWS = bench.choose(gpu=16384, cpu=8)


def make_add_norm(provider, n_cols, dtype, backward):
    x, residual = (
        torch.randn(ADD_NORM_ROWS, n_cols, device=DEVICE, dtype=dtype) for _ in "xr"
    )
    w, b = (torch.rand(n_cols, device=DEVICE) for _ in "wb")
    for t in (x, residual, w, b):
        t.requires_grad_(backward)
    if provider == "triton":
        fn = lambda: add_layer_norm(x, residual, (n_cols,), w, b)
    else:
        norm = (
            layer_norm
            if provider == "triton (apart)"
            else torch.nn.functional.layer_norm
        )
        apart = lambda x, residual: (lambda h: (h, norm(h, (n_cols,), w, b)))(
            x + residual
        )
        if provider == "torch.compile":
            apart = bench.compile_static(apart)
        fn = lambda: apart(x, residual)
    if not backward:
        return fn
    h, y = fn()
    dh, dy = torch.randn_like(h), torch.randn_like(y)
    inputs = (x, residual, w, b)
    return lambda: torch.autograd.grad((h, y), inputs, (dh, dy), retain_graph=True)


def add_norm_benchmark(name, backward):
    return bench.Benchmark(
        name=name,
        x_name=f"C (columns), M = {ADD_NORM_ROWS} rows",
        x_values=bench.choose(gpu=[384, 768, 1024, 2048, 4096], cpu=[100]),
        providers=["triton", "triton (apart)", "torch", "torch.compile"],
        make=lambda provider, n, dtype: make_add_norm(provider, n, dtype, backward),
        work=lambda n, dtype: 4 * ADD_NORM_ROWS * n * dtype.itemsize,
        dtypes=(torch.float32, torch.bfloat16),
        smoke_x=100,
        headline_x=384,
    )


add_norm_forward = bench.run(add_norm_benchmark("add-layer-norm-forward", False))
add_norm_backward = bench.run(add_norm_benchmark("add-layer-norm-backward", True))

# %%
# The GPT on both
# ---------------
# Chapter 12's blocks now hand each addition to the norm that follows it: a block takes
# the stream as (x, the update not yet added) and returns it so, and ``layers.add_norm``
# adds and normalizes. PyTorch's layers do it as before, an addition then
# ``F.layer_norm``, the same operations in the same order; ours call ``add_layer_norm``.
# The training command uses ``FusedAdamW`` when our layers train on one GPU (PyTorch's
# fused AdamW otherwise, and under DDP or FSDP). Three steps of a small model in fp32,
# from the same parameters on the same batch, must give the same losses: ours with
# ``FusedAdamW``, PyTorch's with its fused AdamW. (Parameters are not compared after a
# step: Adam's first step moves each by about lr × sign(g), and where g is near zero,
# rounding decides the sign.)

cfg = Config(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=2, dropout=0.0)
torch.manual_seed(0)
idx = torch.randint(84, (cfg.batch_size, cfg.block_size + 1), device=DEVICE)
losses = {}
for use_triton in (True, False):
    torch.manual_seed(1)
    model = GPT(cfg.model_config(84)).to(DEVICE)
    model.use_triton = use_triton
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0},
    ]
    lr, betas = torch.tensor(1e-2, device=DEVICE), (0.9, 0.99)
    if use_triton:
        optimizer = FusedAdamW(groups, lr=lr, betas=betas)
    else:
        optimizer = torch.optim.AdamW(
            groups, lr=lr, betas=betas, fused=True, capturable=True
        )
    losses[use_triton] = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()
        optimizer.step()
        losses[use_triton].append(loss.item())
for step, (a, b) in enumerate(zip(losses[True], losses[False], strict=True), start=1):
    print(f"step {step}: loss {a:.6f} (ours), {b:.6f} (PyTorch's)")
assert losses[True][-1] < losses[True][0], "the model should learn"
torch.testing.assert_close(losses[True], losses[False], rtol=0, atol=1e-4)

# %%
# The glue between the kernels
# ----------------------------
# The profile also lists PyTorch's kernels between ours: copies, casts, joins, sums.
# ``lab/step_glue.py`` finds the line of Python behind each without a GPU: it runs one
# step at a tiny width on the CPU, catches every PyTorch operator at the dispatcher, and
# charges one of the backward to the forward line that recorded its autograd node. Three
# kinds of glue went.
#
# Attention reads q, k and v in place, strided views of the QKV product (B, T, 3, H, D).
# Autograd, going back through those views, stacked dQ, dK and dV (a join) and copied the
# stack into the product's layout (a strided copy): two more passes over 3 × M × C
# values. Chapter 12's ``QKVAttention`` takes the product itself, and its backward gives
# chapter 11's kernels three views of one (B, T, 3C) gradient to write into.
#
# Under autocast every product cast its weight and its bias to bf16, a launch each, and
# the backward cast each gradient back to fp32, another. ``cast_all`` casts them all in one
# launch through a table as the optimizer's (a row per weight: address, size, place in one
# buffer), and its backward their gradients back the same way. The backward of
# ``add_layer_norm`` wrote the stream's gradient in fp32, which a cast then read again to
# give the bf16 update its own: the kernel now writes both (``HAS_DX_LOW``).

# @save ops/adamw


# A join, then a cast, read every weight twice: 0.7 GB a step more at GPT-2 small's shape
# (85 million weights), 0.3 GB for the gradients. Here each program casts a block of one
# tensor into its place, which starts on 16 elements, so that wide loads and stores apply.
# Weights stay put: their table is kept. Gradients move between eager steps, and a CUDA
# graph's recording, which may not pin memory, copies theirs from rows pinned before it.


@lean
@triton.jit
def cast_joined_kernel(
    table_ptr,  # int64 rows of 4: address, numel, start in out, first program
    block_row_ptr,  # int32, per program: the row of the tensor its block belongs to
    like_ptr,  # a tensor of the sources' dtype
    out_ptr,
    ALIGNED: tl.constexpr,  # every address 16-byte aligned, every numel a multiple of 8
    BF16_BY_HAND: tl.constexpr,  # to bf16 under the interpreter, which truncates
    BLOCK: tl.constexpr,
):
    program_id = tl.program_id(axis=0)
    row = table_ptr + tl.load(block_row_ptr + program_id).to(tl.int64) * 4
    source = tl.load(row).to(tl.pointer_type(like_ptr.dtype.element_ty))
    numel, start, first = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    if ALIGNED:
        source, numel = tl.multiple_of(source, 16), tl.multiple_of(numel, 8)
    start = tl.multiple_of(start, 16)  # CAST_ALIGN
    offsets = (program_id - first).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(source + offsets, mask=mask)
    if BF16_BY_HAND:  # to nearest, ties to even, as a GPU's conversion and PyTorch's
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN kept
    tl.store(out_ptr + start + offsets, x.to(out_ptr.dtype.element_ty), mask=mask)


CAST_BLOCK, CAST_WARPS, CAST_ALIGN = 4096, 4, 16
CAST_LAYOUTS = {}  # (device, sizes) -> program-to-row map, starts, total
CAST_TABLES = {}  # (device, (address, numel) of each) -> its table on the device
CAST_TABLES_KEPT = 8  # sets of tensors
CAST_RECORDED = []  # tables a CUDA graph reads (and the host rows it copies them from)
CAST_SPARES = {}  # (device, tensors) -> pinned rows, for a recording to copy a table from


def cast_layout(device, sizes):
    """Each tensor's start in the joined buffer, its size, and each program's row."""
    starts, block_rows, total = [], [], 0
    for i, n in enumerate(sizes):
        starts.append(total)
        block_rows += [i] * -(-n // CAST_BLOCK)
        total = -(-(total + n) // CAST_ALIGN) * CAST_ALIGN
    block_rows = torch.tensor(block_rows, dtype=torch.int32).to(device)
    return block_rows, starts, total


def cast_table(tensors, starts, capturing):
    """The table of ``tensors`` on their device (None while recording without a spare).
    Copied from pinned rows without waiting; a recording copies from rows kept for good,
    which its replays read again."""
    rows, blocks = [], 0
    for t, start in zip(tensors, starts, strict=True):
        rows.append((t.data_ptr(), t.numel(), start, blocks))
        blocks += -(-t.numel() // CAST_BLOCK)
    rows, device = torch.tensor(rows, dtype=torch.int64), tensors[0].device
    if device.type != "cuda":
        return rows.to(device)
    spare_key = (device, len(tensors))
    if not capturing:  # a spare for the next recording: pinning may not be recorded
        CAST_SPARES.setdefault(spare_key, torch.empty_like(rows).pin_memory())
        return rows.pin_memory().to(device, non_blocking=True)
    spare = CAST_SPARES.pop(spare_key, None)
    if spare is None:
        return None
    spare.copy_(rows)
    table = torch.empty(rows.shape, dtype=torch.int64, device=device)
    table.copy_(spare, non_blocking=True)
    CAST_RECORDED.append((table, spare))
    return table


def cast_joined(dtype, tensors):
    """Contiguous ``tensors`` of one dtype cast to ``dtype`` into one buffer, each read
    once, in one launch: views of it, of their shapes (None where that cannot be: mixed
    dtypes, strides, a CUDA-graph recording before any eager call of those sizes)."""
    device = tensors[0].device if tensors else None
    if not tensors or device.type != DEVICE.type:  # host tensors on a GPU machine
        return None
    if any(
        not t.is_contiguous() or t.dtype != tensors[0].dtype or t.device != device
        for t in tensors
    ):
        return None
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    sizes = tuple(t.numel() for t in tensors)
    layout = CAST_LAYOUTS.get((device, sizes))
    if layout is None:
        if capturing:
            return None
        layout = CAST_LAYOUTS[device, sizes] = cast_layout(device, sizes)
    block_rows, starts, total = layout
    key = (device, tuple((t.data_ptr(), t.numel()) for t in tensors))
    table = CAST_TABLES.get(key)
    if table is None:
        table = cast_table(tensors, starts, capturing)
        if table is None:
            return None
        while len(CAST_TABLES) >= CAST_TABLES_KEPT:
            CAST_TABLES.pop(next(iter(CAST_TABLES)))
        CAST_TABLES[key] = table
    if capturing and not any(table is kept for kept, _ in CAST_RECORDED):
        CAST_RECORDED.append((table, None))  # replayed later: never to be freed
    out = torch.empty(total, device=device, dtype=dtype)
    aligned = all(t.data_ptr() % 16 == 0 and t.numel() % 8 == 0 for t in tensors)
    if len(block_rows):
        cast_joined_kernel[(len(block_rows),)](
            table,
            block_rows,
            tensors[0],
            out,
            ALIGNED=aligned,
            BF16_BY_HAND=INTERPRET and dtype == torch.bfloat16,
            BLOCK=CAST_BLOCK,
            num_warps=CAST_WARPS,
        )
    return tuple(
        out[start : start + t.numel()].view(t.shape)
        for t, start in zip(tensors, starts, strict=True)
    )


# %%
with torch.device("meta"):
    model = GPT(shakespeare.model_config(84))
linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
weights = [model.tokens.weight] + [t for m in linears for t in (m.weight, m.bias)]
megabytes = sum(t.numel() for t in weights) * 4 / 1e6
print(
    f"{len(weights)} weights of products, {megabytes:.0f} MB in fp32. Launches a step"
)
print(f"cast one by one: {2 * len(weights)}; at once: 2 (one each way)")

# The fused backward writes the gradient that autograd made through the views, bit for
# bit (the same kernels): chapter 12's general path, split views and ``attention``.
layers = TritonLayers()
qkv = torch.randn(2, 9, 3 * 16, device=DEVICE, requires_grad=True)
fused = torch.autograd.grad(layers.qkv_attention(qkv, 2).sum(), qkv)[0]
q, k, v = split_heads(qkv, 2)
through_views = torch.autograd.grad(layers.attention(q, k, v).sum(), qkv)[0]
assert fused.is_contiguous() and torch.equal(fused, through_views)

# %%
# Chapter 12's race measures what both fusions give the whole step: ``make bench``
# records it again with the new blocks and optimizer, and the profile above, recorded
# before and after, says which kernels went and what their time became.
#
# What we learned
# ---------------
# * A profile of the whole step, grouped by kernel, says where the time outside the
#   products goes; the bytes of each part, at the GPU's bandwidth, say what fusing it
#   can win.
# * One launch can update many tensors where they live: a table of their addresses, and
#   of each program's tensor. Tensors we own (the moments) can simply be one flat
#   buffer.
# * A kernel with two outputs takes two incoming gradients: the residual addition's
#   backward costs nothing once the norm's backward adds them.
# * Glue hides in autograd's backward of views and casts: a function that owns the whole
#   layout (the QKV product, all weights at once) writes its gradient where it belongs.
#
# Exercises
# ---------
# 1. ``clip_grad_norm`` reads every gradient once more than the update does. Could the
#    norm of this step's gradients be summed where they are written (the products' dW)?
# 2. Keep the moments in bf16 (the update in fp32): how many bytes a parameter is that,
#    and how far does the loss curve move?
# 3. Fuse the embedding's addition (tokens + positions) into the first block's norm.
#    What is different about its backward?
