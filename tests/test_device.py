"""The device profile (runtime/device.py): the GPU classes' figures, the override, and the
paths a capability opens (never Hopper's to a GPU that is not NVIDIA's or not sm_90)."""

import os
import subprocess
import sys
import types

import pytest
from stepkernels.runtime import device
from stepkernels.runtime.device import INTERPRETER, PROFILES, DeviceProfile, named_profile
import torch

KB = 1024
H100 = DeviceProfile("NVIDIA H100 80GB HBM3", "nvidia", (9, 0), 132, 227 * KB, True)
A100 = DeviceProfile("NVIDIA A100-SXM4-80GB", "nvidia", (8, 0), 108, 163 * KB, True)
T4 = DeviceProfile("Tesla T4", "nvidia", (7, 5), 40, 64 * KB, False)
MI300X = DeviceProfile("AMD Instinct MI300X", "amd", (9, 4), 304, 64 * KB, True)


def test_the_classes_figures():
    # Shared memory a block may opt in to (CUDA's programming guide, by compute capability)
    # and the SMs of the GPU each profile stands for.
    assert PROFILES["sm80"].shared_memory == 163 * KB and PROFILES["sm80"].sm_count == 108
    assert PROFILES["sm86"].shared_memory == PROFILES["sm89"].shared_memory == 99 * KB
    assert PROFILES["sm90"].shared_memory == 227 * KB and PROFILES["sm90"].sm_count == 132
    assert all(p.bf16 and p.nvidia for p in PROFILES.values())


def test_paths_by_capability():
    assert [name for name, p in PROFILES.items() if p.tma] == ["sm90"]
    assert [name for name, p in PROFILES.items() if p.fp8] == ["sm89", "sm90"]
    assert not T4.tma and not T4.fp8 and not A100.tma


def test_a_gpu_that_is_not_nvidias_takes_no_nvidia_path():
    # An MI300 reports capability 9.4: no TMA, no wgmma, no PTX, whatever the numbers.
    assert not MI300X.nvidia and not MI300X.tma and not MI300X.fp8
    as_h100 = PROFILES["sm90"].within(MI300X)
    assert as_h100.vendor == "amd" and not as_h100.tma and not as_h100.fp8
    assert as_h100.shared_memory == 64 * KB


def test_an_override_changes_choices_not_the_hardware():
    # On an H100 every profile is within reach: its figures as they are.
    for name, named in PROFILES.items():
        within = named.within(H100)
        assert within.shared_memory == named.shared_memory and within.tma == named.tma
        assert within.sm_count == named.sm_count and within.name == name
    # On an A100, "sm90" chooses for 132 SMs but keeps the A100's shared memory and no TMA.
    as_h100 = PROFILES["sm90"].within(A100)
    assert as_h100.sm_count == 132 and as_h100.shared_memory == 163 * KB
    assert not as_h100.tma and not as_h100.fp8
    # On a T4 (no bf16 in hardware), no profile gives bf16.
    assert not any(p.within(T4).bf16 for p in PROFILES.values())


def test_an_unknown_profile_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"'sm70' names no device profile: choose one of sm80, sm86"):
        named_profile("sm70")


def test_the_interpreter_chooses_as_before():
    # No GPU, no override: the interpreter's profile (small grids, every dtype emulated).
    assert INTERPRETER.sm_count == 4 and INTERPRETER.fp8 and not INTERPRETER.tma
    assert not INTERPRETER.gpu and all(p.gpu for p in PROFILES.values())


def test_hardware_found_on_rocm_is_amds(monkeypatch):
    # What hardware() makes of a ROCm build of torch on an MI300X (simulated).
    properties = types.SimpleNamespace(name="AMD Instinct MI300X", major=9, minor=4,
                                       multi_processor_count=304)  # fmt: skip
    monkeypatch.setattr(device, "ON_GPU", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: True)
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    device.hardware.cache_clear()
    try:
        found = device.hardware()
    finally:
        device.hardware.cache_clear()
    assert found.vendor == "amd" and found.capability == (9, 4)
    assert not found.tma and not found.fp8 and not found.nvidia


PROBE = """
import stepkernels
from stepkernels.ops import matmul, long_rows
from stepkernels.runtime import core, device, tiles
print(device.profile().name, core.sm_count(), matmul.ON_HOPPER, len(tiles.FP8_DTYPES),
      long_rows.OPAQUE_MOVES.value)
"""


CASES = {
    None: "interpreter 4 False 1 False",
    "sm80": "sm80 108 False 0 False",
    "sm86": "sm86 72 False 0 False",
    "sm89": "sm89 58 False 1 False",
    "sm90": "sm90 132 True 1 False",
    "h100": None,  # misspelt
}


@pytest.fixture(scope="module")
def probes():
    """PROBE's output in a fresh Python for each profile (the interpreter: the override is
    taken as it is), run side by side."""
    running = {}
    for profile in CASES:
        env = {k: v for k, v in os.environ.items() if k != "STEPKERNELS_DEVICE_PROFILE"}
        env["TRITON_INTERPRET"] = "1"
        if profile is not None:
            env["STEPKERNELS_DEVICE_PROFILE"] = profile
        running[profile] = subprocess.Popen([sys.executable, "-c", PROBE], env=env, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    done = {}
    for profile, process in running.items():
        out, err = process.communicate()
        done[profile] = (process.returncode, out, err)
    return done


@pytest.mark.parametrize("profile", [p for p, expected in CASES.items() if expected])
def test_the_override_reaches_the_launch_rules(probes, profile):
    # In a fresh Python: the SM count, the Hopper path and fp8 follow the profile named
    # (no inline PTX under the interpreter, whatever the profile).
    returncode, out, err = probes[profile]
    assert returncode == 0, err[-2000:]
    assert out.split() == CASES[profile].split()


def test_a_misspelt_override_stops_the_import(probes):
    returncode, _, err = probes["h100"]
    assert returncode != 0
    assert "STEPKERNELS_DEVICE_PROFILE='h100' names no device profile" in err
