"""ops.adamw: the code of chapter 15, The training step outside the products."""

# Generated from tutorials/15-training-step.py by tools/export.py: edit the chapter, then `make
# export`.

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
