"""python -m stepkernels.train on several processes, on the CPU: torchrun starts 2 processes on
gloo, our kernels under Triton's interpreter, a model of a few thousand parameters, 2 steps.

The core: one process with --grad-accum 2 and two processes with the same global batch and
seed run the same micro-batches with the same dropout masks, so they end with the same
parameters (here bitwise under DDP, within fp32 rounding under FSDP2); a checkpoint that 2
processes wrote resumes on 1 and goes on as the 1-process run does.

Run as a script under torchrun, this file is the worker: it trains through the command
(``train.main``), spying on what each process saw and saved, and dumps that per rank.
"""

import contextlib
import io
import json
import math
import os
from pathlib import Path
import shutil
import subprocess
import sys

import pytest
import small_text
import stepkernels
from stepkernels.models import data as datasets
from stepkernels.models import distributed, train
from stepkernels.models.config import Config, check_config
from stepkernels.models.gpt import GPT, ConfigError
from stepkernels.runtime.core import ON_GPU
import torch

SMALL = [
    *("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8"),
    *("--batch-size", "4", "--max-steps", "2", "--warmup-steps", "1"),
    *("--learning-rate", "0.01", "--min-lr", "0.001", "--dropout", "0.1"),
    *("--eval-interval", "0", "--eval-batches", "1", "--log-interval", "1"),
    *("--sample-tokens", "0", "--use-triton", "--step", "eager", "--dtype", "float32"),
]
SITES = 3  # dropout sites of a 1-layer model: the embeddings', attention's, the MLP's
WORLD_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
on_two_gpus = pytest.mark.skipif(
    not ON_GPU or torch.cuda.device_count() < 2, reason="NCCL on 2 GPUs: the lead's machine"
)


# --------------------------------------------------------------------------- the worker
def worker(dump: Path, argv: list[str]) -> None:
    """One process of a torchrun launch: train through the command, then dump what this
    rank saw (its training batches), saved (torch.save's paths) and holds (parameters,
    optimizer steps, dropout seeds)."""
    rank = int(os.environ["RANK"])
    saved, batches = [], []
    real_save, real_batch, real_train = torch.save, train.Trainer.batch, train.Trainer.train

    def save(obj, path, *args, **kwargs):
        saved.append(str(path))
        return real_save(obj, path, *args, **kwargs)

    def batch(self, split, offsets):
        x, y = real_batch(self, split, offsets)
        if split == "train":
            batches.append(x.clone())
        return x, y

    def run(self, *args, **kwargs):
        summary = real_train(self, *args, **kwargs)
        # While the processes are still a group: FSDP's shards are gathered.
        full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        state = {
            "rank": rank,
            "step": self.step,
            "saved": list(saved),
            "batches": batches,
            "params": {name: full(p).clone() for name, p in self.model.named_parameters()},
            "seeds": self.model.seeds.clone(),
            "history": self.history,
        }
        real_save(state, dump / f"rank{rank}.pt")
        return summary

    torch.save, train.Trainer.batch, train.Trainer.train = save, batch, run
    train.main(argv)


# -------------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A prepared dataset of small_text.TEXT (3,000 characters)."""
    return small_text.prepare(tmp_path_factory.mktemp("data"))


def torchrun(out_dir: Path, data_dir: Path, *args: str, gpus: bool = False, tuning: str | None = None) -> dict:
    """Two processes of the command under torchrun (on the CPU, or one GPU each); each
    rank's dump, by rank, and what rank 0 printed. ``tuning``: STEPKERNELS_PARALLEL_TUNING."""
    dump = out_dir.parent / f"{out_dir.name}-dump"
    dump.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(stepkernels.__file__).parents[1]), env.get("PYTHONPATH", "")])
    if not gpus:
        env["TRITON_INTERPRET"] = "1"
    env.pop(distributed.TUNING_VARIABLE, None)
    if tuning is not None:
        env[distributed.TUNING_VARIABLE] = tuning
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--standalone", __file__, str(dump)),
        *(*SMALL, "--data-dir", str(data_dir), "--out-dir", str(out_dir), *args),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dumps = {rank: torch.load(dump / f"rank{rank}.pt", map_location="cpu", weights_only=False) for rank in (0, 1)}
    return dumps | {"stdout": done.stdout}


def one_process(out_dir: Path, data_dir: Path, *args: str) -> str:
    """The command in this process (no torchrun): what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.main([*SMALL, "--data-dir", str(data_dir), "--out-dir", str(out_dir), *args])
    return printed.getvalue()


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """The same global batch of 4 sequences, seed and dropout: DDP on 2 processes and one
    process with --grad-accum 2 train steps 1 and 2; then step 3 on FSDP2's 2 processes from
    the 1-process checkpoint, and on one process from DDP's."""
    if ON_GPU:
        pytest.skip("gloo on the CPU")
    folder = tmp_path_factory.mktemp("runs")
    for variable in WORLD_VARIABLES:
        assert variable not in os.environ, f"run the tests without torchrun's {variable}"
    runs = {"folder": folder}
    # a time limit never reached: the processes agree on it at every step
    runs["ddp"] = torchrun(folder / "ddp", data_dir, "--time-limit-s", "3600")
    runs["accum"] = one_process(folder / "accum", data_dir, "--grad-accum", "2")
    step_3 = ("--resume", "--max-steps", "3")
    shutil.copytree(folder / "accum", folder / "fsdp")
    runs["fsdp"] = torchrun(folder / "fsdp", data_dir, *step_3, "--parallel", "fsdp")
    shutil.copytree(folder / "ddp", folder / "resumed")
    runs["resumed"] = one_process(folder / "resumed", data_dir, *step_3, "--grad-accum", "2")
    return runs


def checkpoint(runs, name):
    return torch.load(runs["folder"] / name / "checkpoint.pt", weights_only=True)


def events(folder: Path) -> list[dict]:
    """The log of the folder's last run (a resumed run appends to the log)."""
    lines = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    starts = [i for i, event in enumerate(lines) if event["event"] == "start"]
    return lines[starts[-1] :]


# ------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_both_ranks_train_and_rank_0_alone_writes(kind, runs):
    ranks, steps = runs[kind], {"ddp": [1, 2], "fsdp": [3]}[kind]
    assert ranks[0]["step"] == ranks[1]["step"] == steps[-1]
    path = str(runs["folder"] / kind / "checkpoint.tmp")  # written, then renamed
    assert ranks[0]["saved"] == [path] and ranks[1]["saved"] == []
    log = events(runs["folder"] / kind)
    assert [e["event"] for e in log] == ["start", *["log"] * len(steps), "eval", "end"]  # one process's
    assert log[0]["processes"] == 2 and log[0]["parallel"] == kind
    assert log[0]["tuning"] == sorted(distributed.DEFAULT_TUNING)  # STEPKERNELS_PARALLEL_TUNING unset
    assert [e["step"] for e in log if e["event"] == "log"] == steps
    assert all(math.isfinite(e["loss"]) for e in log if e["event"] == "log")
    losses = [[(h["train_loss"], h["val_loss"]) for h in ranks[rank]["history"]] for rank in (0, 1)]
    assert math.isfinite(log[-2]["val_loss"]) and losses[0] == losses[1]  # averaged over ranks
    name = {"ddp": "DDP", "fsdp": "FSDP2"}[kind]
    assert (
        f"4 sequences a step = 2 processes x 1 micro-batches of 2 | 2 processes, on the CPU, {name} over gloo"
        in ranks["stdout"]
    )
    assert ranks["stdout"].count(f"step {steps[-1]}/") == 1  # rank 0 prints, rank 1 does not


def test_ranks_see_their_own_rows_of_the_steps_batch(runs, data_dir):
    """Each step's batch is drawn once from (seed, split, step): rank r takes rows 2r, 2r+1."""
    tokens = datasets.load_shakespeare(data_dir, prepare=False).train
    for kind, steps in (("ddp", [0, 1]), ("fsdp", [2])):
        for i, step in enumerate(steps):
            starts = datasets.window_starts(1337, "train", step, 4, len(tokens) - 8 - 1)
            whole = torch.stack([tokens[s : s + 8].long() for s in starts.tolist()])
            mine = [runs[kind][rank]["batches"][i] for rank in (0, 1)]
            assert not torch.equal(mine[0], mine[1])
            torch.testing.assert_close(torch.cat(mine), whole, rtol=0, atol=0)


def test_ddp_keeps_the_ranks_parameters_equal_and_their_dropout_seeds_apart(runs):
    ranks = runs["ddp"]
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], value, rtol=0, atol=0, msg=name)
    # Rank 1 drew with the seeds of the step's micro-batch 1, two steps after the start.
    assert torch.equal(ranks[1]["seeds"], ranks[0]["seeds"] + SITES)
    assert torch.equal(checkpoint(runs, "ddp")["seeds"], ranks[0]["seeds"])
    assert torch.equal(runs["fsdp"][1]["seeds"], runs["fsdp"][0]["seeds"] + SITES)


def test_two_processes_train_as_one_process_with_grad_accum_2(runs):
    """The same micro-batches and dropout masks: DDP averages the two processes' gradients as
    one process sums its halves, bit for bit here; then FSDP2 (from the 1-process
    checkpoint) and one process (from DDP's) take step 3 alike, FSDP2 within rounding."""
    for ours, one, exact in (
        (checkpoint(runs, "ddp"), checkpoint(runs, "accum"), dict(rtol=0, atol=0)),
        (checkpoint(runs, "fsdp"), checkpoint(runs, "resumed"), dict(rtol=1e-5, atol=1e-7)),
    ):
        for name, value in one["model"].items():
            torch.testing.assert_close(ours["model"][name], value, **exact, msg=name)
        for i, moments in one["optimizer"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours["optimizer"]["state"][i][key], moments[key], **exact)
            assert ours["optimizer"]["state"][i]["step"] == moments["step"]
        val = [[h["val_loss"] for h in run["history"]] for run in (ours, one)]
        assert val[0] == pytest.approx(val[1], rel=1e-6)
        assert torch.equal(ours["seeds"], one["seeds"])
        assert ours["processes"] == 2 and one["processes"] == 1
    assert "4 sequences a step = 1 process x 2 micro-batches of 2 | one process" in runs["accum"]


def test_checkpoints_resume_on_another_number_of_processes(runs, data_dir):
    """DDP's checkpoint (2 processes) resumed on one; the one process's resumed by FSDP2 on
    two; FSDP2's gathered checkpoint loads into a model of one process."""
    printed = runs["resumed"]
    assert "at step 2, written by 2 processes, continued by 1 process" in printed
    assert "saved with grad_accum 1, this run has 2" in printed and "step 3/3" in printed
    assert "at step 2, written by 1 process, continued by 2 processes" in runs["fsdp"]["stdout"]
    before, after = checkpoint(runs, "ddp"), checkpoint(runs, "resumed")
    assert after["step"] == 3 and math.isfinite(after["history"][-1]["val_loss"])
    assert all(not torch.equal(value, before["model"][name]) for name, value in after["model"].items())
    state = checkpoint(runs, "fsdp")
    model = GPT(Config(**state["config"]).model_config(len(state["chars"])))
    model.load_state_dict(state["model"])  # strict: every name and shape


# ------------------------------------------------------------------------ bad launches
@pytest.fixture
def command(data_dir, tmp_path, capsys, monkeypatch):
    """The command in this process under a made-up launch: (exit status, stdout, stderr)."""

    def call(*args, **environment):
        for variable in WORLD_VARIABLES:
            monkeypatch.delenv(variable, raising=False)
        for variable, value in environment.items():
            monkeypatch.setenv(variable, value)
        try:
            train.main([*SMALL, "--data-dir", str(data_dir), "--out-dir", str(tmp_path / "run"), *args])
            status = 0
        except SystemExit as stop:
            status = stop.code
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return status, out, " ".join(err.split())

    return call


LAUNCHED = dict(WORLD_SIZE="3", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def test_a_batch_that_does_not_split_over_the_processes_is_refused(command):
    status, out, err = command(**LAUNCHED)  # 4 sequences over 3 processes
    assert status == 2 and out == "" and err.startswith("usage: python -m stepkernels.train")
    assert "error: argument --batch-size: 4 sequences (the whole step's) do not split into 3 processes" in err
    assert "give a multiple of 3 (3 or 6)" in err
    status, _, err = command("--grad-accum", "3")
    assert status == 2 and "into 1 process x 3 micro-batches (--grad-accum)" in err
    status, _, err = command("--grad-accum", "0")
    assert status == 2 and "--grad-accum: expected an int >= 1, got 0" in err


def test_only_rank_0_prints_an_error_that_all_share(command):
    # Rank 1 on a second machine (local rank 0): a machine of one GPU has its GPU, so the
    # error is the batch's, which every rank finds and rank 0 alone prints.
    status, out, err = command(**{**LAUNCHED, "RANK": "1", "LOCAL_RANK": "0"})
    assert status == 2 and out == err == ""


@pytest.mark.parametrize(
    "environment, message",
    [
        (dict(WORLD_SIZE="2", RANK="0"), "WORLD_SIZE is 2 but MASTER_ADDR and MASTER_PORT unset"),
        (dict(WORLD_SIZE="two"), "the environment's WORLD_SIZE is 'two', not a whole number"),
        (dict(LAUNCHED, RANK="3"), "the environment says rank 3 (local 0) of 3 processes, which cannot be"),
    ],
)
def test_a_broken_launch_says_to_use_torchrun(environment, message, command):
    status, _, err = command(**environment)
    assert status == 2 and f"error: argument --parallel: {message}" in err
    assert "torchrun --nproc-per-node N -m stepkernels.train" in err


def test_gpus_without_nccl_or_with_too_few_are_refused(command, monkeypatch):
    monkeypatch.setattr(distributed.core, "ON_GPU", True)  # as if on GPUs
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(distributed.dist, "is_nccl_available", lambda: False)
    status, _, err = command(**dict(LAUNCHED, WORLD_SIZE="2"))
    assert status == 2 and "--parallel: training on several GPUs needs NCCL" in err
    monkeypatch.setattr(distributed.dist, "is_nccl_available", lambda: True)
    status, _, err = command(**dict(LAUNCHED, RANK="2", LOCAL_RANK="2"))  # a rank's own
    assert status == 2 and "process 2 wants GPU 2 (LOCAL_RANK), but this machine shows 2" in err
    assert "--nproc-per-node 2 or fewer" in err


def test_fsdp_without_torchrun_runs_one_process_and_says_so(command):
    status, out, err = command("--parallel", "fsdp", "--no-use-triton", "--max-steps", "1")
    assert status == 0, err
    assert "note: one process (WORLD_SIZE unset or 1): --parallel fsdp shards nothing" in " ".join(out.split())
    assert "step 1/1" in out


def test_the_config_check_takes_the_world():
    check_config(Config(batch_size=64), world=8)
    with pytest.raises(ConfigError, match="64 sequences .* do not split into 8 processes x 3"):
        check_config(Config(batch_size=64, grad_accum=3), world=8)


# ------------------------------------------------------------------------- on GPUs
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: on the GPU")
def test_the_graph_step_accumulates_as_eager_does_on_the_gpu(data_dir):
    """One GPU: the whole-step graph records both micro-batches of --grad-accum 2."""
    data = datasets.load_shakespeare(data_dir, prepare=False)
    shape = dict(n_layer=1, n_head=2, n_embd=64, block_size=8, batch_size=8, dropout=0.0)
    run = dict(max_steps=8, warmup_steps=1, eval_interval=0, eval_batches=1, log_interval=1)
    files = dict(out_dir="", checkpoint=False, sample_tokens=0, dtype="bfloat16")
    losses = {}
    for step, accum in (("eager", 1), ("eager", 2), ("graph", 2)):
        cfg = Config(**shape, **run, **files, step=step, grad_accum=accum)
        trainer = train.Trainer(cfg, data)
        trainer.train(log=lambda line: None)
        losses[step, accum] = [loss for _, loss in trainer.losses]
    assert losses["graph", 2] == pytest.approx(losses["eager", 2], abs=2e-2)
    assert losses["eager", 2] == pytest.approx(losses["eager", 1], abs=2e-2)


@on_two_gpus
def test_two_gpus_train_as_one_gpu_with_grad_accum(data_dir, tmp_path):
    """Two processes on NCCL, one GPU each, against one GPU with --grad-accum 2, in fp32
    (our products in tf32): DDP (asked for the whole-step graph, which falls back to
    eager), FSDP2, and a resume of DDP's checkpoint on one GPU."""
    fp32 = ("--dtype", "float32")
    ddp = torchrun(tmp_path / "ddp", data_dir, *fp32, "--step", "graph", gpus=True)
    assert "the whole-step CUDA graph is not recorded across processes" in " ".join(ddp["stdout"].split())
    assert "2 processes, one GPU each, DDP over NCCL" in ddp["stdout"]
    for name, value in ddp[0]["params"].items():
        torch.testing.assert_close(ddp[1]["params"][name], value, rtol=0, atol=0, msg=name)
    fsdp = torchrun(tmp_path / "fsdp", data_dir, *fp32, "--parallel", "fsdp", gpus=True)
    assert "FSDP2 over NCCL" in fsdp["stdout"]
    one_process(tmp_path / "accum", data_dir, *fp32, "--grad-accum", "2")
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu", weights_only=True)
    one = load("accum")
    for kind in ("ddp", "fsdp"):
        ours = load(kind)
        assert ours["history"][-1]["val_loss"] == pytest.approx(one["history"][-1]["val_loss"], rel=1e-3)
        gaps = [(ours["model"][name] - value).abs().mean().item() for name, value in one["model"].items()]
        assert max(gaps) < 1e-4, kind  # rounding: atomics and the order of the sums differ
    shutil.copytree(tmp_path / "ddp", tmp_path / "resumed")
    printed = one_process(tmp_path / "resumed", data_dir, *fp32, "--resume", "--max-steps", "3", "--grad-accum", "2")
    assert "written by 2 processes, continued by 1 process" in printed and load("resumed")["step"] == 3


@on_two_gpus
def test_fsdp_in_bf16_trains_alike_with_and_without_its_tunings_on_two_gpus(data_dir, tmp_path):
    """bf16 autocast on NCCL: FSDP2 with its products gathered in bf16 (the norms fp32), the
    last block kept, prefetch, fused AdamW and the local clip, against FSDP2 with none of
    them; DDP with its tunings against none. The same numbers up to the order of the GPU's
    sums (bit for bit on gloo: tests/test_parallel_tuning.py)."""
    bf16 = ("--dtype", "bfloat16")
    for kind in ("fsdp", "ddp"):
        runs = {
            tuning: torchrun(
                tmp_path / f"{kind}-{tuning}", data_dir, *bf16, "--parallel", kind, gpus=True, tuning=tuning
            )
            for tuning in ("none", "default")
        }
        assert runs["default"][0]["history"][-1]["val_loss"] == pytest.approx(
            runs["none"][0]["history"][-1]["val_loss"], rel=1e-3
        )
        for name, value in runs["none"][0]["params"].items():
            gap = (runs["default"][0]["params"][name] - value).abs().max().item()
            assert gap < 1e-3, (kind, name, gap)  # lr 0.01: a step moves a weight ~1e-2


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2:])
    sys.exit(0)
