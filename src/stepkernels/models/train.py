"""Train chapter 12's GPT on Shakespeare's plays, character by character.

    python -m stepkernels.train                       # nanoGPT's shakespeare_char model
    python -m stepkernels.train --no-use-triton       # the same model on PyTorch's layers
    python -m stepkernels.train --step eager --max-steps 200 --out-dir runs/quick

The whole configuration is ``Config`` below; every field is also a command-line option. On a
GPU the products run in bf16 under autocast, and ``--step graph`` (the default there) records
the whole training step, optimizer included, as one CUDA graph (chapter 08). Progress goes to
standard output; a checkpoint to resume from (``--resume``) goes to ``out_dir`` at every
evaluation; the run ends with text sampled from ``prompt``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
import hashlib
import math
import os
from pathlib import Path
import time

from stepkernels.models.data import load_shakespeare
from stepkernels.models.gpt import GPT
from stepkernels.runtime import core
from stepkernels.runtime.graphs import side_stream
import torch

STEPS = ("eager", "graph", "compile")


@dataclass
class Config:
    # The model: nanoGPT's shakespeare_char (about 10.7M parameters).
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256
    dropout: float = 0.2
    # Optimization: AdamW, linear warm-up, cosine decay to min_lr at max_steps.
    batch_size: int = 64
    max_steps: int = 5000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta2: float = 0.99
    grad_clip: float = 1.0
    # How it runs: our kernels or PyTorch's; the step eager, as a CUDA graph or compiled.
    use_triton: bool = True
    step: str = "graph" if core.ON_GPU else "eager"
    dtype: str = "bfloat16"  # autocast dtype on a GPU ("float32": no autocast)
    seed: int = 1337
    # Bookkeeping.
    eval_interval: int = 250  # steps between evaluations (0: only at the end)
    eval_batches: int = 20
    log_interval: int = 50
    time_limit_s: float = 0.0  # stop after this many seconds (0: no limit)
    out_dir: str = "runs/shakespeare"
    checkpoint: bool = True
    resume: bool = False
    prompt: str = "ROMEO:"
    sample_tokens: int = 300


def learning_rate(step: int, cfg: Config) -> float:
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = min(
        1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    )
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only. On a GPU: fused, capturable and with the
    learning rate in a tensor, so a CUDA graph of the step replays it."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay},
              {"params": vectors, "weight_decay": 0.0}]  # fmt: skip
    betas = (0.9, cfg.beta2)
    if not core.ON_GPU:
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas)
    lr = torch.tensor(cfg.learning_rate, device=core.DEVICE)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True, capturable=True)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # queued on the stream: no synchronization
        else:
            group["lr"] = lr


class Trainer:
    """One training run: the model, its optimizer, the data and the step as configured."""

    def __init__(self, cfg: Config, data=None):
        if cfg.step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {cfg.step!r}")
        if cfg.step == "graph" and not core.ON_GPU:
            raise ValueError("--step graph needs a GPU (CUDA graphs): use --step eager")
        self.cfg, self.device = cfg, core.DEVICE
        self.data = data if data is not None else load_shakespeare()
        torch.manual_seed(cfg.seed)
        self.model = GPT(self.data.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head,
                         cfg.n_embd, cfg.dropout, cfg.use_triton).to(self.device)  # fmt: skip
        self.optimizer = make_optimizer(self.model, cfg)
        self.forward = (
            torch.compile(self.model) if cfg.step == "compile" else self.model
        )
        autocast = core.ON_GPU and cfg.dtype != "float32"
        self.autocast_dtype = getattr(torch, cfg.dtype) if autocast else None
        self.splits = {
            name: getattr(self.data, name).to(self.device) for name in ("train", "val")
        }
        # Every batch is fixed by (seed, step): both providers see the same data, and a
        # resumed run continues where it stopped.
        self.window = torch.arange(cfg.block_size + 1, device=self.device)
        self.offsets = torch.zeros(
            cfg.batch_size, dtype=torch.int64, device=self.device
        )
        self.step, self.history, self.graph, self.history_start = 0, [], None, 0
        self.losses = []  # (step, mean training loss since the last log line)
        self.loss_sum = torch.zeros((), device=self.device)

    def autocast(self):
        enabled = self.autocast_dtype is not None
        return torch.autocast(self.device.type, self.autocast_dtype, enabled=enabled)

    def batch_offsets(self, split: str, index: int) -> torch.Tensor:
        """The random windows of batch ``index`` of a split, a function of the seed alone."""
        key = repr((self.cfg.seed, split, index)).encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
        generator = torch.Generator().manual_seed(seed)
        high = len(self.splits[split.removeprefix("eval-")]) - self.cfg.block_size - 1
        return torch.randint(high, (self.cfg.batch_size,), generator=generator)

    def batch(self, split: str, offsets: torch.Tensor):
        rows = self.splits[split][offsets[:, None] + self.window].long()
        return rows[:, :-1], rows[:, 1:]

    def training_step(self) -> torch.Tensor:
        """Forward, backward, clipping and update on the batch at ``self.offsets``."""
        x, y = self.batch("train", self.offsets)
        with self.autocast():
            _, loss = self.forward(x, y)
        loss.backward()
        if self.cfg.grad_clip > 0:  # a tensor result: no synchronization
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        return loss.detach()

    def run_step(self) -> None:
        set_learning_rate(self.optimizer, learning_rate(self.step, self.cfg))
        offsets = self.batch_offsets("train", self.step)
        self.offsets.copy_(offsets, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            loss = self.static_loss
        elif self.cfg.step == "graph" and self.step >= self.history_start + 3:
            loss = self.capture()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            if self.cfg.step == "graph":  # warm-up steps on a side stream, as CUDA asks
                with side_stream() as side:
                    loss = self.training_step()
                torch.cuda.current_stream().wait_stream(side)
            else:
                loss = self.training_step()
        self.loss_sum += loss
        self.step += 1

    def capture(self) -> torch.Tensor:
        """Record the step as a CUDA graph (recording runs nothing), then replay it."""
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = self.training_step()
        self.graph.replay()
        return self.static_loss

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        losses = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=self.device)
            for i in range(self.cfg.eval_batches):
                x, y = self.batch(
                    split, self.batch_offsets(f"eval-{split}", i).to(self.device)
                )
                with self.autocast():
                    total += self.forward(x, y)[1].float()
            losses[split] = total.item() / self.cfg.eval_batches
        self.model.train()
        return losses

    def save(self, path: Path) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "seeds": self.model.seeds, "step": self.step, "history": self.history,
                 "config": asdict(self.cfg)}  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # never half a checkpoint

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.model.seeds.copy_(state["seeds"])
        self.step, self.history = state["step"], state["history"]

    def sample(self, prompt: str, tokens: int) -> str:
        self.model.eval()
        generator = torch.Generator(self.device).manual_seed(self.cfg.seed)
        idx = self.data.encode(prompt)[None].to(self.device)
        with self.autocast():
            out = self.model.generate(idx, tokens, top_k=None, generator=generator)
        self.model.train()
        return self.data.decode(out[0].tolist())

    def train(self, log=print) -> dict:
        """Train to ``max_steps`` (or the time limit); returns a summary of the run."""
        cfg = self.cfg
        checkpoint = Path(cfg.out_dir) / "checkpoint.pt"
        if cfg.resume and checkpoint.exists():
            self.load(checkpoint)
            log(f"resumed from {checkpoint} at step {self.step}")
        self.history_start = self.step
        tokens_per_step = cfg.batch_size * cfg.block_size
        start = last = time.perf_counter()
        steady_tokens, steady_seconds, eval_seconds = 0, 0.0, 0.0
        while self.step < cfg.max_steps:
            self.run_step()
            done = self.step == cfg.max_steps
            elapsed = time.perf_counter() - start
            out_of_time = cfg.time_limit_s > 0 and elapsed >= cfg.time_limit_s
            if self.step % cfg.log_interval and not (done or out_of_time):
                continue
            steps = (
                self.step - self.history_start
            ) % cfg.log_interval or cfg.log_interval
            loss = self.loss_sum.item() / steps  # waits for the GPU
            self.loss_sum.zero_()
            self.losses.append((self.step, loss))
            now = time.perf_counter()
            if self.step - self.history_start > cfg.log_interval:  # warm-up is over
                steady_tokens += steps * tokens_per_step
                steady_seconds += now - last - eval_seconds
            elif core.ON_GPU:  # measure steady training, not one-time autotuning
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            eval_seconds, last = 0.0, now
            rate = steady_tokens / steady_seconds if steady_seconds else float("nan")
            line = f"step {self.step:5d} | loss {loss:.4f} | {rate:,.0f} tokens/s"
            evaluate = cfg.eval_interval and self.step % cfg.eval_interval == 0
            if evaluate or done or out_of_time:
                losses = self.evaluate()
                self.history.append({"step": self.step, "tokens": self.step * tokens_per_step,
                                     "train_loss": losses["train"], "val_loss": losses["val"],
                                     "seconds": time.perf_counter() - start})  # fmt: skip
                line += (
                    f" | val {losses['val']:.4f} | {self.history[-1]['seconds']:.0f} s"
                )
                if cfg.checkpoint:
                    self.save(checkpoint)
                eval_seconds = time.perf_counter() - now
            log(line)
            if out_of_time:
                break
        # What the allocator held at most once warm: a CUDA graph's private pool included,
        # which allocated bytes would miss (its blocks count as free between replays).
        peak = torch.cuda.max_memory_reserved() / 2**30 if core.ON_GPU else float("nan")
        text = self.sample(cfg.prompt, cfg.sample_tokens) if cfg.sample_tokens else ""
        return {"history": self.history, "tokens_per_s": rate, "peak_memory_gib": peak,
                "seconds": time.perf_counter() - start, "sample": text}  # fmt: skip


def parse_config(argv=None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in fields(Config):
        option, default = "--" + field.name.replace("_", "-"), field.default
        if isinstance(default, bool):
            parser.add_argument(
                option, action=argparse.BooleanOptionalAction, default=default
            )
        else:
            parser.add_argument(option, type=type(default), default=default)
    return Config(**vars(parser.parse_args(argv)))


def main(argv=None) -> None:
    cfg = parse_config(argv)
    print("  ".join(f"{k}={v}" for k, v in asdict(cfg).items()))
    summary = Trainer(cfg).train()
    print(f"{summary['seconds']:.0f} s, {summary['tokens_per_s']:,.0f} tokens/s, "
          f"peak memory {summary['peak_memory_gib']:.2f} GiB\n---\n{summary['sample']}")  # fmt: skip


if __name__ == "__main__":
    main()
