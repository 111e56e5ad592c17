"""Training on several processes: ``torchrun --nproc-per-node N -m stepkernels.train``.

Each process trains the same model on its share of every batch. With ``--parallel ddp`` (the
default) each holds the whole model and optimizer, and PyTorch's DistributedDataParallel
averages the gradients over the processes during the backward; with ``--parallel fsdp``
(FSDP2, ``torch.distributed.fsdp.fully_shard``) each holds a 1/N shard of the parameters,
gradients and optimizer state, and gathers a block's parameters just before the block runs.
Our kernels are autograd Functions: their gradients reach the parameters' ``.grad`` through
autograd like any other, which is where DDP's and FSDP's hooks take them.

What this module decides, and ``train.Trainer`` relies on:

* The launch comes from torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``). Without ``WORLD_SIZE`` (or with 1) the run is one
  process, whatever ``--parallel`` says. The backend is NCCL on GPUs, one GPU a process
  (``LOCAL_RANK``), and gloo on the CPU.
* ``--batch-size`` is the global batch, the sequences of one optimizer step over all
  processes: each process takes ``batch_size / world`` of them, in ``grad_accum``
  micro-batches of ``batch_size / (world * grad_accum)``. Every step's batch is drawn once,
  from (seed, split, step) as on one process, and process r takes the r-th slice of its rows,
  so no two processes see the same rows, and one process with ``--grad-accum N`` runs exactly
  the micro-batches that N processes run (``train.Trainer.batch_offsets``).
* Dropout: micro-batch m of the step (m = rank * grad_accum + j, j the micro-batch on its
  process) draws with the seeds of the model's ``seeds`` buffer plus m times the number of
  dropout sites, so each process draws other masks than the others, and one process with
  ``--grad-accum N`` draws the masks of N processes (``seed_offset``). DDP must then not copy
  rank 0's buffers into the others at each forward (``broadcast_buffers=False``). PyTorch's
  own dropout (``--no-use-triton``) draws from torch's generator, seeded with seed + rank.
* Checkpoints hold the whole model and optimizer in one process's layout, written by rank 0
  (``full_state``) and read by every process (``load_full_state``): a run written by N
  processes resumes on any number, FSDP's or DDP's or one process's.

How the wrappers are tuned (``TUNINGS``; none of them changes a number the step computes,
each is on unless ``STEPKERNELS_PARALLEL_TUNING`` says otherwise, a lab switch to measure
them one at a time, ``lab/data_parallel.py --tunings``):

* DDP keeps the gradients as views of its all-reduce buckets (no copy back after the
  all-reduce), is told the graph is the same every step (``static_graph``), and fills a
  bucket with about one block's gradients (``bucket_bytes``); ``static_graph`` only without
  gradient accumulation, which PyTorch's reducer does not support with it.
* FSDP2 gathers the blocks' products' weights in the autocast dtype (a
  ``MixedPrecisionPolicy``: half the bytes of an fp32 gather, and no cast per product) and
  reduces their gradients in fp32. The products cast those weights under autocast anyway,
  so nothing changes; the norms' weights stay fp32 with the embeddings in the root's
  group, as autocast keeps the norms in fp32 (``products``). The last block stays gathered for the backward, which
  starts with it; the next block's gather is issued as a block starts; the optimizer is
  PyTorch's fused AdamW over the shards; the clip's norm comes from the local shards with
  one all-reduce (``clip_grad_norm``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import inspect
import os
import warnings

from stepkernels.models.gpt import ConfigError
from stepkernels.runtime import core
import torch
import torch.distributed as dist

PARALLEL = ("ddp", "fsdp")
LAUNCH = "torchrun --nproc-per-node N -m stepkernels.train"
TUNING_VARIABLE = "STEPKERNELS_PARALLEL_TUNING"
TUNINGS = {  # name: what it does; on by default unless its name is in OFF_BY_DEFAULT
    "bucket-view": "DDP: the gradients are views of the all-reduce buckets",
    "static-graph": "DDP: the same graph every step (static_graph)",
    "bucket-cap": "DDP: a bucket of about one block's gradients",
    "mixed-precision": "FSDP2: blocks gathered in the autocast dtype, reduced in fp32",
    "last-block": "FSDP2: the last block stays gathered from forward to backward",
    "prefetch": "FSDP2: the next block's gather issued as a block starts",
    "fused-adamw": "FSDP2: PyTorch's fused AdamW over the shards",
    "local-clip": "FSDP2: the clip's norm from the local shards, one all-reduce",
    "keep-gathered": "FSDP2: every block stays gathered from forward to backward",
}
OFF_BY_DEFAULT = frozenset({"keep-gathered"})  # memory for speed: the user's choice
DEFAULT_TUNING = frozenset(TUNINGS) - OFF_BY_DEFAULT


def tuning_from_environment(environ=None) -> frozenset:
    """The tunings ``STEPKERNELS_PARALLEL_TUNING`` asks for: unset, the defaults; else a
    comma-separated list, read left to right, of ``default``, ``none``, a name (on) and
    ``-name`` (off). ConfigError("parallel") for a name not in ``TUNINGS``."""
    environ = os.environ if environ is None else environ
    text = environ.get(TUNING_VARIABLE)
    if text is None:
        return DEFAULT_TUNING
    chosen = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        name = item.removeprefix("-")
        if item in ("default", "none"):
            chosen = set(DEFAULT_TUNING if item == "default" else ())
        elif name in TUNINGS:
            (chosen.discard if item.startswith("-") else chosen.add)(name)
        else:
            raise ConfigError(
                "parallel",
                f"{TUNING_VARIABLE} names {item!r}: give a comma-separated list of "
                f"default, none, and names from {', '.join(TUNINGS)} (-name: off)",
            )
    return frozenset(chosen)


@dataclass(frozen=True)
class Launch:
    """Where this process stands, from torchrun's environment: one process if not launched."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0


def launch_from_environment(environ=None) -> Launch:
    """The Launch torchrun's variables describe; ConfigError("parallel") for a partial or
    malformed set (what to do: launch with torchrun)."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" not in environ:
        return Launch()
    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        text = environ.get(name, "0" if name != "WORLD_SIZE" else "")
        try:
            values[name] = int(text)
        except ValueError:
            raise ConfigError(
                "parallel",
                f"the environment's {name} is {text!r}, not a whole number: start "
                f"several processes with `{LAUNCH}`",
            ) from None
    world, rank, local_rank = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or not 0 <= local_rank <= rank:
        raise ConfigError(
            "parallel",
            f"the environment says rank {rank} (local {local_rank}) of {world} "
            f"processes, which cannot be: start them with `{LAUNCH}`",
        )
    if world > 1:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(n)]
        if missing:
            raise ConfigError(
                "parallel",
                f"WORLD_SIZE is {world} but {' and '.join(missing)} unset: the processes "
                f"cannot find one another; start them with `{LAUNCH}`",
            )
    return Launch(rank, world, local_rank)


def launch_is_main(environ=None) -> bool:
    """False in a process torchrun started with a RANK other than 0 (it stays quiet)."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("RANK", "0")) == 0
    except ValueError:
        return True


def check_launch(launch: Launch) -> None:
    """ConfigError("parallel") where this machine cannot run ``launch``: no
    torch.distributed, no NCCL for GPUs, fewer GPUs than processes on this node."""
    if launch.world == 1:
        return
    if not dist.is_available():
        raise ConfigError(
            "parallel",
            "this PyTorch has no torch.distributed: train on one process (plain "
            "`python -m stepkernels.train`), or install a PyTorch with it",
        )
    if core.ON_GPU:
        if not dist.is_nccl_available():
            raise ConfigError(
                "parallel",
                "training on several GPUs needs NCCL, which this PyTorch build lacks: "
                "install a CUDA build of PyTorch (pytorch.org), or train on one GPU",
            )
        count = torch.cuda.device_count()
        if launch.local_rank >= count:
            raise ConfigError(
                "parallel",
                f"process {launch.rank} wants GPU {launch.local_rank} (LOCAL_RANK), but "
                f"this machine shows {count}: pass --nproc-per-node {count} or fewer "
                "(one process a GPU), or check CUDA_VISIBLE_DEVICES",
            )
    elif not dist.is_gloo_available():
        raise ConfigError(
            "parallel",
            "training on several CPU processes needs gloo, which this PyTorch lacks",
        )


@dataclass(frozen=True)
class Parallel:
    """This process's place in the run, and the groups it talks through."""

    kind: str = "none"  # "ddp" or "fsdp" when world > 1, else "none"
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = core.DEVICE
    backend: str | None = None
    control: object = None  # a gloo group for CPU-side agreement (None: the default)
    tuning: frozenset = DEFAULT_TUNING  # the names of TUNINGS asked for

    @property
    def main(self) -> bool:
        """Rank 0: the process that prints, logs and writes checkpoints."""
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.world > 1

    def describe(self) -> str:
        if not self.several:
            return "one process"
        name = {"ddp": "DDP", "fsdp": "FSDP2"}[self.kind]
        where = "one GPU each" if self.device.type == "cuda" else "on the CPU"
        return f"{self.world} processes, {where}, {name} over {self.backend}"


def start(kind: str, launch: Launch) -> Parallel:
    """Join the process group ``launch`` describes (nothing to join for one process)."""
    if launch.world == 1:
        return Parallel()
    if core.ON_GPU:
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)  # before anything is allocated on the GPU
        dist.init_process_group("nccl", device_id=device)
        # Agreement on CPU values (the time limit) without waiting on the GPU.
        control = dist.new_group(backend="gloo")
        backend = "NCCL"
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        control, backend = None, "gloo"
    return Parallel(
        kind,
        launch.rank,
        launch.world,
        launch.local_rank,
        device,
        backend,
        control,
        tuning_from_environment(),
    )


def stop(parallel: Parallel) -> None:
    if parallel.several and dist.is_initialized():
        dist.destroy_process_group()


def wrap(
    model: torch.nn.Module,
    parallel: Parallel,
    dtype: torch.dtype | None = None,
    accumulates: bool = False,
) -> torch.nn.Module:
    """The module a training step calls: DDP around ``model``, or ``model`` itself sharded
    in place by FSDP2 (a block's products a group; the embeddings, the norms and the output
    in the root's). ``dtype``: the autocast dtype of the products, None without autocast;
    ``accumulates``: whether a step has several micro-batches (``gradient_sync``)."""
    tuning = parallel.tuning
    if parallel.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [parallel.local_rank] if parallel.device.type == "cuda" else None
        # Each process keeps its own dropout seeds: DDP must not copy rank 0's buffers into
        # the others at each forward (it does once, when built; Trainer offsets them after).
        # forward_sync_buffers in newer PyTorch, broadcast_buffers (deprecated there) before.
        own = inspect.signature(DistributedDataParallel).parameters
        name = (
            "forward_sync_buffers"
            if "forward_sync_buffers" in own
            else "broadcast_buffers"
        )
        options = {name: False}
        # After the all-reduce, each gradient is its bucket's view: no copy back.
        options["gradient_as_bucket_view"] = "bucket-view" in tuning
        # Every step runs every parameter in the same order (no unused ones to look for).
        # Not with no_sync's accumulation: PyTorch's reducer then fails its first backward
        # (an INTERNAL ASSERT, pytorch/pytorch#143580; tests/test_parallel_tuning.py).
        options["static_graph"] = "static-graph" in tuning and not accumulates
        if "bucket-cap" in tuning:
            options["bucket_cap_mb"] = bucket_bytes(model) / 2**20
        return DistributedDataParallel(model, device_ids=ids, **options)
    if parallel.kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(parallel.device.type, (parallel.world,))
        half = dtype in (torch.bfloat16, torch.float16)
        if "mixed-precision" in tuning and half:
            # The blocks' products in ``dtype``, as autocast would cast them; the rotary
            # tables a block takes stay fp32 (no cast of its inputs).
            policy = MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
            # The norms' weights join the root's group, in fp32 as autocast keeps them.
            groups = [products(block) for block in model.blocks]
        else:
            policy, groups = MixedPrecisionPolicy(), list(model.blocks)
        sharded = []
        for i, group in enumerate(groups):
            last = i == len(groups) - 1
            keep = "keep-gathered" in tuning or (last and "last-block" in tuning)
            done = fully_shard(
                group, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep
            )
            sharded.append(done[0] if isinstance(done, list) else done)
        fully_shard(model, mesh=mesh)
        if "prefetch" in tuning:  # block i + 1's gather issued as block i starts
            for first, then in zip([model, *sharded], sharded, strict=False):
                first.set_modules_to_forward_prefetch([then])
        # FSDP2 warns that a group returns a view (the logits, a product): an in-place op
        # on it would skip a hook. We never change them in place.
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        return model
    return model


def reshard(model: torch.nn.Module, parallel: Parallel) -> None:
    """After forwards with no backward (an evaluation) under FSDP2: free what the blocks'
    groups keep gathered from forward to backward (``last-block``, ``keep-gathered``), so
    that the next training step starts as every other does. Left gathered, a block's fp32
    weights would be plain tensors at the next forward, where the step's casts
    (``gpt.product_weights``) would take them in, and their gradients would come through
    the casts' backward at the end; FSDP2 (torch 2.13, gloo) still reduces them alike
    (tests/test_parallel_tuning.py finds the same numbers with and without this), but
    that step would be unlike the others. The root's group stays gathered, as FSDP2
    keeps it."""
    if parallel.kind != "fsdp":
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule) and module is not model:
            module.reshard()


def products(block: torch.nn.Module) -> list[torch.nn.Module]:
    """A block's submodules other than its norms: those that hold its products' weights."""
    norms = (torch.nn.LayerNorm, torch.nn.RMSNorm)
    return [m for m in block.children() if not isinstance(m, norms)]


def bucket_bytes(model: torch.nn.Module) -> int:
    """DDP's bucket size for ``model``: the gradients of its largest block (fp32 as the
    parameters). GPT-2 small: 7.09M parameters, 28.4 MB a block, 12 buckets and the
    embeddings' remainder; the all-reduce of the last one ready (the backward's exposed
    tail) is then at most one block's."""
    return max(
        sum(p.numel() * p.element_size() for p in block.parameters())
        for block in model.blocks
    )


def gradient_sync(module: torch.nn.Module, parallel: Parallel, sync: bool):
    """A context for one micro-batch's backward: with ``sync`` False the gradients stay on
    this process (accumulated; DDP's no_sync, FSDP2's set_requires_gradient_sync), with
    True they are averaged over the processes, as after the last micro-batch."""
    if parallel.kind == "ddp" and not sync:
        return module.no_sync()
    if parallel.kind == "fsdp":
        module.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def seed_offset(parallel: Parallel, grad_accum: int, sites: int) -> int:
    """How far this process's dropout seeds start ahead of rank 0's: past the micro-batches
    of the processes before it, each using ``sites`` seeds."""
    return parallel.rank * grad_accum * sites


def all_mean(tensor: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """``tensor`` averaged over the processes, in place (gloo has no AVG: a sum)."""
    if parallel.several:
        dist.all_reduce(tensor)
        tensor /= parallel.world
    return tensor


def clip_grad_norm(parameters, max_norm: float, parallel: Parallel) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does; returns the norm before, a tensor (nothing is
    read on the host). FSDP's gradients are shards (DTensors): the norm's squares are summed
    over this process's shards and all-reduced, one collective where the clip over DTensors
    dispatches each of its steps through DTensor."""
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = any(hasattr(g, "to_local") for g in grads)
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not local:
        return torch.zeros((), device=parallel.device)
    squares = torch.stack(torch._foreach_norm(local)).square().sum()
    if sharded and parallel.several:  # each process holds its shards' part
        dist.all_reduce(squares)
    total = squares.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(local, scale)
    return total


def agree(flag: bool, parallel: Parallel) -> bool:
    """True on every process if it is true on any: a decision they must take together."""
    if not parallel.several:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=parallel.control)
    return bool(value.item())


def parameter_names(model: torch.nn.Module, groups: list) -> list[str]:
    """The parameters' names in the order of the optimizer's groups: the ids of a plain
    ``optimizer.state_dict()``."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in groups for p in group["params"]]


def full_state(model, optimizer, parallel: Parallel) -> tuple[dict, dict] | None:
    """The model's and the optimizer's state dicts as one process would save them, on the
    CPU, on rank 0; None on the other ranks. With FSDP every rank must call it (the shards
    are gathered)."""
    if parallel.kind != "fsdp":
        if not parallel.main:
            return None
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    moments = get_optimizer_state_dict(model, optimizer, options=options)
    if not parallel.main:
        return None
    # Parameter names as keys -> the ids of a plain optimizer state dict.
    index = {n: i for i, n in enumerate(parameter_names(model, optimizer.param_groups))}
    moments = {
        "state": {index[name]: value for name, value in moments["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in moments["param_groups"]
        ],
    }
    return weights, moments


def load_full_state(model, optimizer, weights, moments, parallel: Parallel) -> None:
    """Load what ``full_state`` returned (every process reads the whole checkpoint; FSDP
    keeps its shard). The optimizer keeps its own settings (how it runs: fused, capturable,
    its learning rate's tensor) and takes the saved moments and steps."""
    own = [
        {k: v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]
    if parallel.kind == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        names = parameter_names(model, optimizer.param_groups)
        moments = {
            "state": {names[i]: value for i, value in moments["state"].items()},
            "param_groups": [
                {**group, "params": [names[i] for i in group["params"]]}
                for group in moments["param_groups"]
            ],
        }
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(model, optimizer, moments, options=options)
    else:
        model.load_state_dict(weights)
        optimizer.load_state_dict(moments)
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        group.update(settings)
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                where = p.device if on_device else "cpu"
                state["step"] = state["step"].to(where, torch.float32)
