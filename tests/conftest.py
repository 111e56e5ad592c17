import matplotlib.pyplot as plt
import pytest
import stepkernels  # noqa: F401  (first: without a GPU it selects Triton's interpreter)
from stepkernels.runtime.core import DEVICE
from stepkernels.runtime.device import describe
import torch


def pytest_report_header(config):
    # STEPKERNELS_DEVICE_PROFILE=sm80 (sm86, sm89, sm90) makes the launch rules choose as
    # on that GPU: on the H100, the suite then runs what an A100 (A10, L4) would launch.
    return f"stepkernels launch rules choose for: {describe()}"


def random_tensor(shape, dtype=torch.float32, seed=0, scale=1.0, shift=0.0):
    """Seeded normal values, scale * randn + shift, drawn in fp32 and then rounded to dtype."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale + shift).to(DEVICE, dtype)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """make test runs the tests and the notebooks (nbval) in one pytest-xdist session (-n):
    each test goes to whichever process is free, and each notebook goes whole, its cells in
    order, to one process and its kernel. (xdist's loadgroup would do it with marks, but with
    pytest 9.2 it does not group: xdist 3.8 renames the items' nodeid where pytest no longer
    reads it.) Only for xdist's default distribution; --dist asks for another."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class NotebooksWhole(LoadScopeScheduling):
        # LoadScopeScheduling hands out the largest units first: the notebooks, then the tests.
        # test_targets.py, test_distributed.py and test_parallel_tuning.py go whole too:
        # their tests share one module fixture (every launch recorded; the torchrun runs,
        # 70 to 120 s of both cores, which two processes would each make).
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            wholes = ("test_targets.py", "test_distributed.py", "test_parallel_tuning.py")
            whole = path.endswith((".ipynb", *wholes))
            return path if whole else nodeid

    return NotebooksWhole(config, log)


@pytest.fixture
def as_on_one_gpu(monkeypatch):
    """The training command's make_optimizer as on one GPU (on the CPU's tensors):
    FusedAdamW for our layers (test_train_cli, test_fp16_training)."""
    from stepkernels.models import train

    original = train.make_optimizer

    def make(model, cfg, parallel=None):
        monkeypatch.setattr(train.core, "ON_GPU", True)
        try:
            return original(model, cfg, parallel)
        finally:
            monkeypatch.setattr(train.core, "ON_GPU", False)

    monkeypatch.setattr(train, "make_optimizer", make)
