"""ops.adamw: the code of chapter 15, The training step outside the products."""

# Generated from tutorials/15-training-step.py by tools/export.py: edit the chapter, then `make
# export`.

from stepkernels.runtime.core import DEVICE, check_tensor
from stepkernels.runtime.launch import lean  # cheap repeated launches: chapter 08
from stepkernels.runtime.rows import quiet
import torch
import triton
import triton.language as tl


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


@lean
@triton.jit
def adamw_kernel(
    param_ptr,  # fp32 parameters, updated in place
    grad_ptr,  # their gradients, read, then set to 0 for the next step's backward
    exp_avg_ptr,  # first moment m, fp32
    exp_avg_sq_ptr,  # second moment v, fp32
    lr_ptr,  # the learning rate, a tensor a CUDA graph's replays read afresh
    step_ptr,  # the step number t, already counted for this step
    n_elements,
    lr_value,  # the learning rate when it is a number (LR_IN_TENSOR False)
    beta1,
    beta2,
    eps,
    weight_decay,
    LR_IN_TENSOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(axis=0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    lr = tl.load(lr_ptr).to(tl.float32) if LR_IN_TENSOR else lr_value
    step = tl.load(step_ptr)
    # 1 - beta**t, with beta**t as 2**(t log2 beta): a scalar per program
    correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    param = tl.load(param_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    param = param * (1.0 - lr * weight_decay)  # decoupled weight decay, first
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denominator = tl.sqrt(exp_avg_sq) / tl.sqrt(correction2) + eps
    param -= (lr / correction1) * exp_avg / denominator
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    tl.store(grad_ptr + offsets, tl.zeros_like(grad), mask=mask)


ADAMW_BLOCK, ADAMW_WARPS = 1024, 4


def adamw_update(flat, lr, beta1, beta2, eps, weight_decay, step):
    """One AdamW step over ``flat`` = (params, grads, exp_avg, exp_avg_sq), four fp32
    buffers of one length; ``step``: a one-element fp32 tensor, t of this step."""
    params = flat[0]
    n_elements = params.numel()
    if n_elements == 0:
        return
    in_tensor = isinstance(lr, torch.Tensor)
    if in_tensor and lr.device != params.device:
        raise ValueError(
            f"lr is a tensor on {lr.device}, the parameters on {params.device}: make it "
            f"on theirs, torch.tensor(lr, device='{params.device}')"
        )
    grid = (triton.cdiv(n_elements, ADAMW_BLOCK),)
    with quiet():  # the interpreter's numpy warns at log2(0), for beta = 0
        adamw_kernel[grid](
            *flat,
            lr if in_tensor else step,  # not read when the rate is a number
            step,
            n_elements,
            0.0 if in_tensor else float(lr),
            beta1,
            beta2,
            eps,
            weight_decay,
            LR_IN_TENSOR=in_tensor,
            BLOCK=ADAMW_BLOCK,
            num_warps=ADAMW_WARPS,
        )


class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` as one kernel launch per parameter group (and one that counts
    the steps of all groups).

    At construction each group's parameters move into one flat fp32 buffer, and each
    parameter becomes a view into it; so do their gradients (which stay allocated: zero_grad
    zeroes them in place, and each step leaves them at zero) and the moments. The learning
    rate may be a number or a one-element tensor, which a CUDA graph of the step reads
    afresh at every replay (as ``capturable=True`` does for PyTorch's). The state dict is
    that of ``torch.optim.AdamW``: a checkpoint of either loads into the other.

    Every parameter of a group is updated at every step, whether it got a gradient or not
    (then its gradient is zero: its moments decay, weight decay applies); PyTorch's skips
    parameters whose gradient is None. Move the model to its device before making this
    optimizer: ``model.to(...)`` afterwards would leave the parameters outside the buffers."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2
    ):
        adamw_arguments(lr, betas, eps, weight_decay)
        self.flats = []  # per group: (params, grads, exp_avg, exp_avg_sq) flat buffers
        self.steps = None  # one fp32 step count per group, on the parameters' device
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        for p in params:
            check_tensor(p, "a parameter", (torch.float32,))
        device = params[0].device if params else DEVICE
        if any(p.device != device for p in params):
            raise ValueError(f"a group's parameters must share one device, {device}")
        total = sum(p.numel() for p in params)
        self.flats.append([torch.zeros(total, device=device) for _ in range(4)])
        index = len(self.flats) - 1
        for p, param, grad, _, _ in self.views(index):
            param.copy_(p.detach())
            if p.grad is not None:
                grad.copy_(p.grad)
            p.data, p.grad = param, grad
        steps = torch.zeros(len(self.flats), device=device)
        if self.steps is not None:
            steps[:index] = self.steps
        self.steps = steps
        for group in range(len(self.flats)):  # the new step tensor, in every state
            self.link_state(group)

    def views(self, index):
        """(parameter, then its views of the four flat buffers) for group ``index``."""
        start = 0
        for p in self.param_groups[index]["params"]:
            end = start + p.numel()
            yield p, *(buffer[start:end].view_as(p) for buffer in self.flats[index])
            start = end

    def link_state(self, index):
        """Each parameter's state as PyTorch's AdamW names it: views, and the group's step."""
        for p, _, _, exp_avg, exp_avg_sq in self.views(index):
            self.state[p] = dict(
                step=self.steps[index], exp_avg=exp_avg, exp_avg_sq=exp_avg_sq
            )

    def keep_gradients_in_place(self):
        """Put back a gradient that something replaced (``model.zero_grad()`` sets them to
        None; autograd then allocates new ones), copying its values into the buffer."""
        for index in range(len(self.flats)):
            for p, _, grad, _, _ in self.views(index):
                if p.grad is None:
                    grad.zero_()
                elif p.grad.data_ptr() != grad.data_ptr():
                    grad.copy_(p.grad)
                p.grad = grad

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.keep_gradients_in_place()
        self.steps += 1
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            args = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
            adamw_update(self.flats[index], *args, self.steps[index : index + 1])
        return loss

    def zero_grad(self, set_to_none=True):
        """Zero the gradients in place (they stay views into the buffer: never None)."""
        self.keep_gradients_in_place()
        for flat in self.flats:
            flat[1].zero_()

    def state_dict(self):
        """PyTorch's AdamW's layout: each parameter's own step tensor and moments."""
        saved, index = super().state_dict(), 0
        saved["state"] = {}
        for group in range(len(self.flats)):
            for _, _, _, exp_avg, exp_avg_sq in self.views(group):
                step = self.steps[group].clone()
                entry = dict(step=step, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
                saved["state"][index] = entry
                index += 1
        return saved

    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer or of ``torch.optim.AdamW``."""
        super().load_state_dict(state_dict)  # new tensors in self.state: copied back
        for index, group in enumerate(self.param_groups):
            device = self.flats[index][0].device
            if isinstance(group["lr"], torch.Tensor):  # saved from elsewhere: the CPU's
                group["lr"] = group["lr"].to(device)
            counts = set()
            for p, _, _, exp_avg, exp_avg_sq in self.views(index):
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
