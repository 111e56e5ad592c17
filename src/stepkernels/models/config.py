"""What a training run is: ``Config``, every field a command-line option with its range,
the checks that refuse a bad configuration before anything is loaded, and the presets.

A preset (``presets/*.py``) or a file of your own is a short list of ``name = value`` lines
with comments saying why; ``read_preset`` reads it as text (never running it) and refuses a
name that is no field or a value of the wrong type, with the file and line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field, fields
import difflib
import math
from pathlib import Path

from stepkernels.models.distributed import PARALLEL
from stepkernels.models.gpt import CHOICES, ConfigError, GPTConfig
from stepkernels.runtime import core
from stepkernels.runtime.device import DeviceProfile, profile

STEPS = ("eager", "graph", "compile", "max-autotune")
DTYPES = ("bfloat16", "float16", "float32")
PRESETS = Path(__file__).resolve().parent / "presets"


def default_dtype(
    on_gpu: bool | None = None, device: DeviceProfile | None = None
) -> str:
    """The autocast dtype a run takes unless told: bfloat16 on a GPU with bf16 arithmetic
    in hardware (``device``: the profile the launch rules choose for), float16 with the
    loss scaled on a GPU without (a T4, a V100: torch reports the T4's emulated bf16, the
    profile does not), float32 on a CPU."""
    if not (core.ON_GPU if on_gpu is None else on_gpu):
        return "float32"
    return "bfloat16" if (device or profile()).bf16 else "float16"


def dtype_note(
    dtype: str, on_gpu: bool | None = None, device: DeviceProfile | None = None
) -> str | None:
    """The line a run on a GPU without bf16 prints about its dtype, else None."""
    on_gpu = core.ON_GPU if on_gpu is None else on_gpu
    if dtype != "float16" or not on_gpu or (device or profile()).bf16:
        return None
    return (
        "note: this GPU has no bf16 arithmetic in hardware (before Ampere): the products "
        "run in float16, the default here, with the loss scaled against its narrow "
        "range; --dtype float32 runs without autocast"
    )


def option(default, help: str, *, at_least=None, above=None, below=None, choices=None):
    """A field of ``Config``: its default, its --help line and the values it accepts."""
    limits = dict(at_least=at_least, above=above, below=below, choices=choices)
    return field(default=default, metadata=dict(help=help, **limits))


@dataclass
class Config:
    """A training run: the model's shape, the optimizer, how a step runs, the files and the
    sample. ``python -m stepkernels.train`` makes each field an option (``--n-layer``)."""

    # The model (GPTConfig's fields; the vocabulary comes from the data).
    n_layer: int = option(6, "transformer blocks", at_least=1)
    n_head: int = option(
        6, "attention heads a block, n_embd / n_head <= 128", at_least=1
    )
    n_embd: int = option(
        384, "width of the residual stream, a multiple of n_head", at_least=1
    )
    block_size: int = option(256, "context, in characters", at_least=1)
    dropout: float = option(0.2, "probability of dropping", at_least=0.0, below=1.0)
    bias: bool = option(True, "biases in the linear layers and the norms")
    # The block's choices (chapter 14's layers); the defaults are GPT-2's block.
    norm: str = option(
        "layer", "layer: layer norm; rms: RMSNorm", choices=CHOICES["norm"]
    )
    position: str = option(
        "learned",
        "learned: an embedding added to the input; rotary: q and k turned (RoPE)",
        choices=CHOICES["position"],
    )
    mlp: str = option(
        "gelu", "gelu: GPT-2's MLP; swiglu: Llama's", choices=CHOICES["mlp"]
    )
    n_kv_head: int = option(
        0, "heads of k and v, dividing n_head (grouped-query; 0: n_head)", at_least=0
    )
    mlp_hidden: int = option(
        0,
        "the MLP's inner width (0: 4 n_embd; swiglu: 8 n_embd / 3 rounded up to 64)",
        at_least=0,
    )
    # Optimization: AdamW, linear warm-up, cosine decay to min_lr at max_steps.
    batch_size: int = option(
        64, "sequences a step, over all processes and micro-batches", at_least=1
    )
    grad_accum: int = option(
        1, "micro-batches a step on each process, gradients averaged", at_least=1
    )
    max_steps: int = option(
        5000, "steps of the whole run (a resumed run included)", at_least=1
    )
    learning_rate: float = option(1e-3, "peak learning rate", above=0.0)
    min_lr: float = option(
        1e-4, "learning rate at max_steps, <= learning_rate", at_least=0.0
    )
    warmup_steps: int = option(100, "steps of linear warm-up", at_least=0)
    weight_decay: float = option(0.1, "AdamW's, on the matrices only", at_least=0.0)
    beta2: float = option(0.99, "AdamW's second-moment decay", at_least=0.0, below=1.0)
    grad_clip: float = option(
        1.0, "clip the gradients' norm to this (0: no clipping)", at_least=0.0
    )
    # How it runs: our kernels or PyTorch's; the step eager, as a CUDA graph or compiled.
    use_triton: bool = option(
        True, "our kernels (else PyTorch's layers, same parameters)"
    )
    step: str = option(
        "graph" if core.ON_GPU else "eager",
        "eager; graph: the step as one CUDA graph (a GPU); compile: torch.compile; "
        "max-autotune: torch.compile(mode='max-autotune'), minutes of autotuning first",
        choices=STEPS,
    )
    parallel: str = option(
        "ddp",
        "under torchrun: ddp, a whole model a process; fsdp: FSDP2, a shard a process",
        choices=PARALLEL,
    )
    dtype: str = option(
        default_dtype(),
        "products under autocast in this dtype: bfloat16 (a GPU from sm_80), float16 "
        "(the loss scaled by a GradScaler; a GPU without bf16 takes it unless told, a "
        "CPU runs it too); float32: no autocast",
        choices=DTYPES,
    )
    seed: int = option(
        1337, "seeds the parameters, the batches and the sample", at_least=0
    )
    # Data and bookkeeping.
    data_dir: str = option(
        "", "holds shakespeare/ (empty: $STEPKERNELS_DATA, else ~/.cache/stepkernels)"
    )
    eval_interval: int = option(
        250, "steps between evaluations (0: only at the end)", at_least=0
    )
    eval_batches: int = option(
        20, "batches of each split an evaluation averages", at_least=1
    )
    log_interval: int = option(50, "steps between progress lines", at_least=1)
    time_limit_s: float = option(
        0.0, "stop after this many seconds (0: no limit)", at_least=0.0
    )
    out_dir: str = option(
        "runs/shakespeare", "folder of log.jsonl and checkpoint.pt (empty: no files)"
    )
    checkpoint: bool = option(True, "write out_dir/checkpoint.pt at every evaluation")
    resume: bool = option(False, "continue the run whose checkpoint is in out_dir")
    overwrite: bool = option(False, "start again in an out_dir that holds a run")
    # The sample printed at the end.
    prompt: str = option("ROMEO:", "text the sample starts from")
    sample_tokens: int = option(
        300, "characters to sample at the end (0: none)", at_least=0
    )
    temperature: float = option(1.0, "divides the logits before sampling", above=0.0)
    top_k: int = option(
        0, "sample from the k likeliest characters (0: from all)", at_least=0
    )

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The model's shape (``GPTConfig`` checks it) for a vocabulary of ``vocab_size``."""
        shape = {
            f.name: getattr(self, f.name)
            for f in fields(GPTConfig)
            if f.name != "vocab_size"
        }
        return GPTConfig(vocab_size=vocab_size, **shape)


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------- checks
def accepted(name: str) -> str:
    """What field ``name`` accepts, in words: "an int >= 1", "one of eager, graph"."""
    spec = next(f for f in fields(Config) if f.name == name)
    rules = spec.metadata
    if rules["choices"]:
        return "one of " + ", ".join(rules["choices"])
    kind = {bool: "True or False", int: "an int", float: "a finite number", str: "text"}
    bounds = [
        f"{sign} {rules[key]:g}"
        for key, sign in (("at_least", ">="), ("above", ">"), ("below", "<"))
        if rules[key] is not None
    ]
    return " ".join([kind[type(spec.default)], " and ".join(bounds)]).strip()


def within(value, rules) -> bool:
    return (
        (rules["at_least"] is None or value >= rules["at_least"])
        and (rules["above"] is None or value > rules["above"])
        and (rules["below"] is None or value < rules["below"])
        and (not rules["choices"] or value in rules["choices"])
    )


def of_kind(value, kind) -> bool:
    if kind is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and math.isfinite(value)
    return type(value) is kind


def check_config(cfg: Config, world: int = 1) -> None:
    """Raise ConfigError, naming the field, for the first value out of range: each field's
    range, then the rules between fields and the device's, and that the batch splits over
    ``world`` processes. Reads no file."""
    for spec in fields(Config):
        value = getattr(cfg, spec.name)
        if not (of_kind(value, type(spec.default)) and within(value, spec.metadata)):
            raise ConfigError(
                spec.name, f"expected {accepted(spec.name)}, got {value!r}"
            )
    cfg.model_config(vocab_size=1)  # GPTConfig's rules: heads, their width
    if cfg.min_lr > cfg.learning_rate:
        raise ConfigError(
            "min_lr",
            f"{cfg.min_lr:g} is above learning_rate {cfg.learning_rate:g}: the learning "
            "rate decays to min_lr",
        )
    shares = world * cfg.grad_accum
    if cfg.batch_size % shares:
        below = cfg.batch_size // shares * shares
        above = below + shares
        nearest = f"{below} or {above}" if below else f"{above}"
        raise ConfigError(
            "batch_size",
            f"{cfg.batch_size} sequences (the whole step's) do not split into {world} "
            f"process{'es' if world > 1 else ''} x {cfg.grad_accum} micro-batches "
            f"(--grad-accum) of equal size: give a multiple of {shares} ({nearest}), or "
            "another --grad-accum",
        )
    if cfg.step == "graph" and not core.ON_GPU:
        raise ConfigError(
            "step", "graph needs a GPU (CUDA graphs): on a CPU choose eager"
        )
    if cfg.step in ("compile", "max-autotune") and not core.ON_GPU and cfg.use_triton:
        raise ConfigError(
            "step",
            "compile cannot trace our kernels under Triton's interpreter (no GPU here): "
            "choose eager, or add --no-use-triton to compile PyTorch's layers",
        )
    if cfg.dtype == "bfloat16" and not core.ON_GPU:
        raise ConfigError(
            "dtype",
            "bfloat16 is autocast on a GPU; on a CPU choose float32 (no autocast), or "
            "float16 to try the loss scaling",
        )
    # bf16 in hardware: torch.cuda.is_bf16_supported() says yes on a T4 too (emulated)
    if cfg.dtype == "bfloat16" and not profile().bf16:
        raise ConfigError(
            "dtype",
            "this GPU has no bf16 (before Ampere): choose float16 (autocast, the loss "
            "scaled by a GradScaler) or float32",
        )
    if cfg.dtype == "float16" and cfg.parallel == "fsdp" and world > 1:
        # each process would find overflows in its own shard of the gradients only
        raise ConfigError(
            "dtype",
            "float16's loss scaling is not wired to FSDP's sharded gradients: with "
            "several processes choose --parallel ddp, or --dtype bfloat16 or float32",
        )
    if cfg.resume and cfg.overwrite:
        raise ConfigError(
            "overwrite",
            "--resume continues the run in out_dir, --overwrite starts it again: pass one",
        )
    if (cfg.resume or cfg.checkpoint) and not cfg.out_dir:
        raise ConfigError(
            "out_dir",
            "empty, but checkpoints are written and read there: name a folder, or pass "
            "--no-checkpoint (and no --resume)",
        )
    if cfg.sample_tokens and not cfg.prompt:
        raise ConfigError(
            "prompt",
            "empty: the sample needs at least one character to start from "
            "(or --sample-tokens 0)",
        )


def check_data(cfg: Config, chars: str, split_tokens: dict) -> None:
    """Raise ConfigError where the data cannot serve ``cfg``: a split with no window of
    block_size + 1 tokens to choose from, a prompt outside the vocabulary."""
    for split, tokens in split_tokens.items():
        if tokens < cfg.block_size + 2:
            largest = min(split_tokens.values()) - 2
            raise ConfigError(
                "block_size",
                f"{cfg.block_size} leaves no windows of block_size + 1 tokens to choose "
                f"from in the {split} split of {tokens:,} tokens: at most {largest:,}",
            )
    unknown = "".join(sorted(set(cfg.prompt) - set(chars)))
    if cfg.sample_tokens and unknown:
        raise ConfigError(
            "prompt",
            f"{cfg.prompt!r} has characters outside the data's vocabulary: {unknown!r}; "
            f"its {len(chars)} characters are {chars!r}",
        )


# -------------------------------------------------------------------------- presets
def preset_names() -> list[str]:
    """The presets shipped in ``presets/``, as ``--config`` takes them."""
    names = (path.stem for path in PRESETS.glob("*.py") if path.stem != "__init__")
    return sorted(name.replace("_", "-") for name in names)


def read_preset(name: str) -> dict:
    """The values a preset (by name) or a file of ``name = value`` lines sets. The file is
    read, never run: each line must assign a literal to one of Config's fields."""
    path = PRESETS / f"{name.replace('-', '_')}.py"
    if name not in preset_names():
        path = Path(name)
    if not path.is_file():
        raise ConfigError(
            "config",
            f"no preset or file {name!r}: the presets are {', '.join(preset_names())}, "
            "else give a file's path",
        )
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as error:
        where = f", line {error.lineno}" if getattr(error, "lineno", None) else ""
        raise ConfigError("config", f"{path}{where}: {error}") from error
    known = {spec.name: type(spec.default) for spec in fields(Config)}
    values = {}
    for node in tree.body:
        where = f"{path}, line {node.lineno}"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        single = isinstance(node, ast.Assign) and len(node.targets) == 1
        if not (single and isinstance(node.targets[0], ast.Name)):
            raise ConfigError("config", f"{where}: only `name = value` lines are read")
        name = node.targets[0].id
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError("config", f"{where}: {name} is no option{hint}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError as error:
            message = (
                f"{where}: {name}'s value must be a number, a string, True or False"
            )
            raise ConfigError("config", message) from error
        if known[name] is float and type(value) is int:
            value = float(value)
        if type(value) is not known[name]:
            kind = known[name].__name__
            raise ConfigError(
                "config", f"{where}: {name} must be {kind}, got {value!r}"
            )
        values[name] = value
    return values


def preset(name: str, **changes) -> Config:
    """Config's defaults, then what the preset ``name`` (or a file) sets, then ``changes``."""
    return Config(**{**read_preset(name), **changes})
