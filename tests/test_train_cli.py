"""python -m stepkernels.train and python -m stepkernels.sample: every bad option refused with
argparse's error (exit status 2, the option named, no traceback) before data or a model is
loaded; presets and files, flags over them; checkpoints refused with what to do; the JSONL log.
CPU only, a model of a few thousand parameters, mostly on PyTorch's layers (the kernels' own
path is tests/test_gpt.py's)."""

import json
import runpy
import sys
import zipfile

import pytest
import small_text
from stepkernels.models import config, sample, train
from stepkernels.models import data as datasets
from stepkernels.models.gpt import ConfigError
from stepkernels.runtime.core import ON_GPU
import torch

TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--block-size",
    "8",
    "--batch-size",
    "2",
    "--dropout",
    "0",
    "--max-steps",
    "4",
    "--warmup-steps",
    "1",
    "--eval-interval",
    "2",
    "--eval-batches",
    "1",
    "--log-interval",
    "2",
    "--sample-tokens",
    "0",
    "--no-use-triton",
    "--step",
    "eager",
    "--dtype",
    "float32",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A prepared dataset of small_text.TEXT (3,000 characters)."""
    return small_text.prepare(tmp_path_factory.mktemp("data"))


@pytest.fixture
def run(data_dir, tmp_path, capsys):
    """Call the command in-process: (exit status, stdout, stderr)."""

    def call(*args, program=train.main, out_dir=tmp_path / "run", tiny=True):
        options = [*TINY, "--data-dir", str(data_dir), "--out-dir", str(out_dir)]
        try:
            program([*(options if tiny else []), *args])
            status = 0
        except SystemExit as stop:
            status = stop.code
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return status, out, err

    return call


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the command loads the tokens or builds a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("loaded before the options were checked")

    monkeypatch.setattr(train.datasets, "load_shakespeare", refuse)
    monkeypatch.setattr(train, "GPT", refuse)


BAD_OPTIONS = {  # arguments: what the error must name
    "max_steps 0": (["--max-steps", "0"], "--max-steps: expected an int >= 1, got 0"),
    "log_interval 0": (["--log-interval", "0"], "--log-interval: expected an int >= 1"),
    "eval_batches 0": (["--eval-batches", "0"], "--eval-batches: expected an int >= 1"),
    "batch_size 0": (["--batch-size", "0"], "--batch-size"),
    "grad_accum 0": (["--grad-accum", "0"], "--grad-accum: expected an int >= 1, got 0"),
    "grad_accum not dividing": (["--grad-accum", "3"], "--batch-size: 2 sequences (the whole step's) do not split"),
    "parallel unknown": (["--parallel", "fsdp2"], "--parallel: invalid choice: 'fsdp2'"),
    "eval_interval -1": (["--eval-interval", "-1"], "--eval-interval: expected an int >= 0"),
    "dropout 1": (["--dropout", "1"], "--dropout: expected a finite number >= 0 and < 1"),
    "dropout -0.1": (["--dropout", "-0.1"], "--dropout"),
    "learning_rate 0": (["--learning-rate", "0"], "--learning-rate: expected a finite number > 0"),
    "learning_rate nan": (["--learning-rate", "nan"], "--learning-rate"),
    "min_lr above": (["--min-lr", "0.5"], "--min-lr: 0.5 is above learning_rate"),
    "beta2 1": (["--beta2", "1"], "--beta2"),
    "grad_clip -1": (["--grad-clip", "-1"], "--grad-clip"),
    "seed -1": (["--seed", "-1"], "--seed"),
    "time_limit_s -1": (["--time-limit-s", "-1"], "--time-limit-s"),
    "width and heads": (["--n-embd", "30", "--n-head", "4"], "--n-embd: n_embd (30) must be a multiple"),
    "heads too wide": (["--n-embd", "512", "--n-head", "2"], "--n-head: heads of n_embd / n_head = 256"),
    "n_layer 0": (["--n-layer", "0"], "--n-layer"),
    "step unknown": (["--step", "fast"], "--step: invalid choice: 'fast'"),
    "dtype unknown": (["--dtype", "float64"], "--dtype: invalid choice: 'float64'"),
    "not an int": (["--max-steps", "many"], "--max-steps: invalid int value"),
    "temperature 0": (["--temperature", "0"], "--temperature: expected a finite number > 0"),
    "top_k -1": (["--top-k", "-1"], "--top-k: expected an int >= 0"),
    "sample_tokens -1": (["--sample-tokens", "-1"], "--sample-tokens"),
    "empty prompt": (["--prompt", "", "--sample-tokens", "5"], "--prompt: empty"),
    "resume and overwrite": (["--resume", "--overwrite"], "--overwrite: --resume continues"),
    "empty out_dir": (["--out-dir", ""], "--out-dir: empty"),
    "unknown preset": (["--config", "huge"], "--config: no preset or file 'huge'"),
    # against the data's meta.json (3,000 characters: 300 of validation), tokens unread
    "block_size over the split": (["--block-size", "299"], "--block-size: 299 leaves no windows"),
    "prompt outside the vocabulary": (
        ["--prompt", "ROMEO:", "--sample-tokens", "5"],
        "--prompt: 'ROMEO:' has characters outside",
    ),
}
ON_A_CPU = {
    "graph on a CPU": (["--step", "graph"], "--step: graph needs a GPU"),
    "compile our kernels on a CPU": (["--step", "compile", "--use-triton"], "--step: compile cannot trace"),
    "max-autotune on a CPU": (["--step", "max-autotune", "--use-triton"], "--step: compile cannot trace"),
    "bfloat16 on a CPU": (["--dtype", "bfloat16"], "--dtype: bfloat16 is autocast on a GPU"),
}


@pytest.mark.parametrize("case", [*BAD_OPTIONS, *ON_A_CPU])
def test_a_bad_option_gets_argparses_error_before_anything_loads(case, run, no_loading):
    if case in ON_A_CPU and ON_GPU:
        pytest.skip("a CPU's refusals")
    args, message = {**BAD_OPTIONS, **ON_A_CPU}[case]
    status, out, err = run(*args)
    assert status == 2 and out == ""
    assert err.startswith("usage: python -m stepkernels.train")
    assert f"python -m stepkernels.train: error: argument {message}" in err.replace("\n", " ")


def test_help_shows_the_program_defaults_choices_examples_and_the_data(run):
    status, out, _ = run("--help", tiny=False)
    assert status == 0 and out.startswith("usage: python -m stepkernels.train ")
    flat = " ".join(out.split())
    for shown in (
        "--n-layer N transformer blocks (default: 6)",
        "{eager,graph,compile,max-autotune}",
        "--dtype {bfloat16,float16,float32}",
        "examples:",
        "--config tiny",
        "gpt2-small, modern-shakespeare, shakespeare, tiny",
        "make data",
        "python -m stepkernels.data",
        "$STEPKERNELS_DATA",
        "log.jsonl",
        "--resume or --overwrite",
        "--grad-accum N micro-batches a step on each process",
        "--parallel {ddp,fsdp}",
        "torchrun --nproc-per-node 2 -m stepkernels.train",
    ):
        assert shown in flat, shown


@pytest.mark.parametrize("module", ["stepkernels.train", "stepkernels.sample"])
def test_the_module_runs_as_a_program(module, monkeypatch, capsys):
    """``python -m MODULE`` runs the module as __main__: run here as Python would."""
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_module(module, run_name="__main__")
    assert stop.value.code == 0 and capsys.readouterr().out.startswith(f"usage: python -m {module}")


def test_presets_load_and_flags_override_them():
    tiny, small = config.preset("tiny"), config.preset("gpt2-small")
    assert (small.n_layer, small.n_head, small.n_embd, small.block_size) == (12, 12, 768, 1024)
    assert config.preset("shakespeare") == config.Config()  # the defaults, spelled out
    assert tiny.n_embd == 32 and tiny.dropout == 0.0 and tiny.max_steps < 100
    for name in config.preset_names():
        config.check_config(config.preset(name))
    cfg = train.parse_config(["--config", "tiny", "--n-layer", "3", "--max-steps", "7"])
    assert (cfg.n_layer, cfg.max_steps, cfg.n_embd, cfg.out_dir) == (3, 7, tiny.n_embd, "runs/tiny")
    flags_first = train.parse_config(["--n-layer", "3", "--config", "tiny"])
    assert flags_first.n_layer == 3  # an option beats the file wherever it stands


def test_a_config_file_of_ours_is_read_never_run(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text('"""My run."""\n# a comment\nn_layer = 3\nlearning_rate = 1  # an int for a float\nprompt = "to"\n')
    assert config.read_preset(str(path)) == {"n_layer": 3, "learning_rate": 1.0, "prompt": "to"}
    cfg = train.parse_config(["--config", str(path), "--prompt", "be"])
    assert (cfg.n_layer, cfg.learning_rate, cfg.prompt) == (3, 1.0, "be")


@pytest.mark.parametrize(
    "text, message",
    [
        ("n_embed = 64\n", "line 1: n_embed is no option (did you mean n_embd?)"),
        ("n_layer = 2\nn_head = 2 + x\n", "line 2: n_head's value must be a number"),
        ("n_layer = 'two'\n", "line 1: n_layer must be int, got 'two'"),
        ("import os\n", "line 1: only `name = value` lines are read"),
        ("n_layer = \n", "line 1"),
        ("beta2 = 1.5\n", "--beta2: expected a finite number >= 0 and < 1, got 1.5 (set by --config"),
    ],
)
def test_a_bad_config_file_is_named_with_its_line(text, message, run, tmp_path, no_loading):
    path = tmp_path / "bad.py"
    path.write_text(text)
    status, _, err = run("--config", str(path))
    assert status == 2 and message in err.replace("\n", " ")


def read_log(out_dir):
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.skipif(ON_GPU, reason="its lines are a CPU run's: no MFU, the process's memory")
def test_a_run_writes_progress_lines_its_jsonl_log_and_a_checkpoint(run, tmp_path):
    status, out, err = run("--max-steps", "6", "--sample-tokens", "5", "--prompt", "to")
    assert status == 0, err
    assert "device: CPU | dtype: float32, no autocast" in out
    assert "step 2/6 | loss" in out and "warming up" in out
    assert "step 4/6" in out and "tokens/s" in out and "| ETA " in out
    assert "MFU" not in out  # no GPU's peak to divide by
    (memory,) = [line for line in out.splitlines() if "GiB" in line]
    assert "peak memory of this process" in memory and "(CPU)" in memory and "nan" not in memory
    events = read_log(tmp_path / "run")
    assert [e["event"] for e in events] == ["start", "log", "eval", "log", "eval", "log", "eval", "end"]
    assert events[0]["config"]["max_steps"] == 6 and events[1]["tokens_per_s"] is None
    assert events[3]["tokens_per_s"] > 0 and events[3]["mfu"] is None
    assert [e["step"] for e in events if e["event"] == "eval"] == [2, 4, 6]
    assert out.rstrip().splitlines()[-1].startswith("to")  # the sample
    assert (tmp_path / "run" / "checkpoint.pt").is_file()


def test_evaluations_fall_between_log_lines(run, tmp_path):
    """eval_interval 3 with log_interval 2: evaluations at 3 and 6, not skipped."""
    status, _, err = run("--max-steps", "6", "--eval-interval", "3")
    assert status == 0, err
    events = read_log(tmp_path / "run")
    assert [e["step"] for e in events if e["event"] == "eval"] == [3, 6]
    assert [e["step"] for e in events if e["event"] == "log"] == [2, 3, 4, 6]


def test_a_run_folder_is_not_overwritten_without_asking(run, tmp_path):
    assert run()[0] == 0
    status, _, err = run()
    assert status == 2 and "--out-dir:" in err and "holds a run (checkpoint.pt and log.jsonl)" in err
    assert "--resume" in err and "--overwrite" in err
    status, _, err = run("--overwrite", "--max-steps", "2")
    assert status == 0, err
    assert [e["event"] for e in read_log(tmp_path / "run")][0] == "start"  # a new log
    assert read_log(tmp_path / "run")[-1]["step"] == 2


def test_resume_continues_and_prints_what_changed(run, tmp_path):
    assert run("--max-steps", "2")[0] == 0
    status, out, err = run("--resume", "--max-steps", "4", "--learning-rate", "0.002")
    assert status == 0, err
    assert "saved with learning_rate 0.001, this run has 0.002" in out
    assert "saved with max_steps 2, this run has 4" in out
    assert "at step 2" in out and "step 4/4" in out
    starts = [e["step"] for e in read_log(tmp_path / "run") if e["event"] == "start"]
    assert starts == [0, 2]  # one log, appended


def test_resume_refuses_without_a_checkpoint(run, tmp_path, no_loading):
    status, _, err = run("--resume")
    assert status == 2 and "--resume: no checkpoint to resume at" in err


def test_resume_refuses_a_finished_run_and_another_shape(run, tmp_path):
    assert run("--max-steps", "2")[0] == 0
    status, _, err = run("--resume", "--max-steps", "2")  # was an UnboundLocalError
    assert status == 2 and "--max-steps: the run finished: its checkpoint is at step 2" in err
    status, _, err = run("--resume", "--n-embd", "32")
    flat = err.replace("\n", " ")
    assert status == 2 and "--n-embd: the checkpoint was saved with n_embd 16, this run has 32" in flat


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "a zip", "other"])
def test_a_damaged_checkpoint_is_named_with_what_to_do(damage, run, tmp_path):
    assert run()[0] == 0
    path = tmp_path / "run" / "checkpoint.pt"
    whole = path.read_bytes()
    content = {"garbage": b"not a checkpoint at all", "empty": b"", "truncated": whole[: len(whole) // 2]}
    if damage == "other":  # torch's, but not ours
        torch.save({"weights": torch.zeros(2)}, path)
    elif damage == "a zip":  # a zip archive, but not torch's
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "no tensors here")
    else:
        path.write_bytes(content[damage])
    status, _, err = run("--resume", "--max-steps", "6")
    flat = " ".join(err.split())
    assert status == 2 and str(path) in flat and "pass --overwrite to start the run again" in flat
    assert {
        "garbage": "is not a checkpoint",
        "empty": "is empty",
        "truncated": "is not a checkpoint: not the zip archive",
        "a zip": "could not be read (RuntimeError",
        "other": "lacks chars",
    }[damage] in flat


def test_sample_from_a_checkpoint(run, tmp_path):
    assert run()[0] == 0
    checkpoint = str(tmp_path / "run" / "checkpoint.pt")
    status, out, _ = run(
        "--checkpoint",
        checkpoint,
        "--prompt",
        "to",
        "--tokens",
        "5",
        "--top-k",
        "3",
        "--no-use-triton",
        program=sample.main,
        tiny=False,
    )
    assert status == 0 and out.startswith("to") and len(out.rstrip("\n")) == 7
    again = run(
        "--checkpoint",
        checkpoint,
        "--prompt",
        "to",
        "--tokens",
        "5",
        "--top-k",
        "3",
        "--no-use-triton",
        program=sample.main,
        tiny=False,
    )
    assert again[1] == out  # seeded


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens", "0"], "--tokens: expected an int >= 1"),
        (["--temperature", "0"], "--temperature: expected a finite number > 0"),
        (["--temperature", "inf"], "--temperature"),
        (["--top-k", "-2"], "--top-k: expected an int >= 0"),
        (["--prompt", ""], "--prompt: empty"),
        (["--prompt", "ROMEO:"], "--prompt: 'ROMEO:' has characters outside the model's vocabulary"),
        (["--checkpoint", "nowhere.pt"], "--checkpoint: no checkpoint at nowhere.pt"),
    ],
)
def test_sample_refuses_bad_arguments(args, message, run, tmp_path):
    assert run()[0] == 0
    checkpoint = ["--checkpoint", str(tmp_path / "run" / "checkpoint.pt")]
    status, out, err = run(*checkpoint, *args, program=sample.main, tiny=False)
    assert status == 2 and out == "" and f"python -m stepkernels.sample: error: argument {message}" in err


def test_a_cpu_run_of_hours_is_warned_and_the_tiny_one_is_not():
    if ON_GPU:
        pytest.skip("a CPU's warning")
    warning = train.cpu_estimate(config.Config(), 84, 5000)
    assert "at least" in warning and "hours" in warning and "--config tiny" in warning
    assert "FLOPs" in warning and "1e+11 FLOP/s" in warning
    tiny = config.preset("tiny")
    assert train.cpu_estimate(tiny, 84, tiny.max_steps) is None


def test_the_trainer_refuses_what_used_to_crash(data_dir):
    """max_steps 0 (an UnboundLocalError for `rate`), log_interval 0 and eval_batches 0
    (ZeroDivisionError): a ConfigError naming the field, from the API too."""
    data = datasets.load_shakespeare(data_dir, prepare=False)
    base = train.parse_config([*TINY, "--out-dir", "", "--no-checkpoint"])
    for name in ("max_steps", "log_interval", "eval_batches"):
        with pytest.raises(ConfigError) as refused:
            train.Trainer(config.Config(**{**vars(base), name: 0}), data)
        assert refused.value.field == name
    one = train.Trainer(config.Config(**{**vars(base), "max_steps": 1}), data)
    summary = one.train(log=lambda line: None)  # one interval: too short to time
    assert summary["tokens_per_s"] is None and summary["steps"] == 1


def test_grad_accum_trains_as_the_whole_batch_and_counts_its_tokens(run, tmp_path):
    """--grad-accum 2 on batches of 2 sequences: two micro-batches of 1, each loss scaled by
    1/2, whose gradients sum to the whole batch's mean: the same run within fp32 rounding,
    the same tokens a step (2 x 8) in the log."""
    runs = {}
    for accum in (1, 2):
        status, out, err = run("--grad-accum", str(accum), out_dir=tmp_path / f"accum{accum}")
        assert status == 0, err
        runs[accum] = read_log(tmp_path / f"accum{accum}")
        assert [e["tokens"] for e in runs[accum] if e["event"] == "log"] == [32, 64]
    assert "batch: 2 sequences a step = 1 process x 2 micro-batches of 1 | one process" in out
    losses = {accum: [e.get("loss", e.get("val_loss")) for e in log[1:-1]] for accum, log in runs.items()}
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
    one, two = (torch.load(tmp_path / f"accum{k}" / "checkpoint.pt", weights_only=True) for k in (1, 2))
    for name, value in one["model"].items():
        torch.testing.assert_close(two["model"][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_grad_accum_gradients_are_the_whole_batchs(data_dir):
    """AdamW hardly sees a gradient's scale, so the run above would pass with each
    micro-batch's loss unscaled: the gradients themselves must be the batch's mean's."""
    data = datasets.load_shakespeare(data_dir, prepare=False)
    grads = {}
    for accum in (1, 2):
        options = ["--out-dir", "", "--no-checkpoint", "--grad-clip", "0", "--grad-accum", str(accum)]
        cfg = train.parse_config([*TINY, *options])  # no clipping: it would rescale them
        trainer = train.Trainer(cfg, data)
        trainer.run_step()
        grads[accum] = {name: p.grad for name, p in trainer.model.named_parameters()}
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[2][name], grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.skipif(ON_GPU, reason="the CPU run of what a GPU runs; on a GPU, tests/test_gpt.py")
def test_fused_adamw_checkpoint_resumes_as_an_unbroken_run(run, tmp_path, as_on_one_gpu):
    """Our layers on one GPU train with FusedAdamW (chapter 15): 2 steps, a checkpoint, 2 more
    steps resumed give the parameters and moments of 4 steps without a break."""
    from stepkernels import FusedAdamW

    model = train.GPT(config.Config(n_layer=1, n_head=2, n_embd=16).model_config(10))
    assert isinstance(train.make_optimizer(model, config.Config()), FusedAdamW)
    assert not isinstance(train.make_optimizer(model, config.Config(use_triton=False)), FusedAdamW)
    ours = ["--use-triton", "--eval-interval", "2"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert run(*ours, "--max-steps", "4", out_dir=straight)[0] == 0
    assert run(*ours, "--max-steps", "2", out_dir=broken)[0] == 0
    status, out, err = run(*ours, "--max-steps", "4", "--resume", out_dir=broken)
    assert status == 0, err
    assert "at step 2" in out
    a, b = (train.read_checkpoint(folder / "checkpoint.pt") for folder in (straight, broken))
    assert a["step"] == b["step"] == 4
    for name, weight in a["model"].items():
        torch.testing.assert_close(b["model"][name], weight, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    for index, state in a["optimizer"]["state"].items():
        assert float(b["optimizer"]["state"][index]["step"]) == float(state["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b["optimizer"]["state"][index][key], state[key], rtol=1e-6, atol=1e-9)
