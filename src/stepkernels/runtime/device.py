"""The device the launch rules choose for: its capability, SMs, shared memory and dtypes.

Hand-written. Launch rules read ``profile()`` instead of assuming an H100: the number of
SMs for persistent grids, the shared memory a program may use (with opt-in, as Triton
checks it at launch) for tiles and pipeline stages, and the features a path needs (TMA
descriptors and wgmma on sm_90, fp8 from sm_89, bf16 from sm_80).

``STEPKERNELS_DEVICE_PROFILE`` names a GPU class (``sm80``, ``sm86``, ``sm89``, ``sm90``) to
choose for instead of the device found:

- under Triton's interpreter (no GPU), the launch rules choose exactly as on that class: the
  kernels run on the CPU with that GPU's tiles, stages and grids, and
  ``tools/check_targets.py`` records those launches to compile them for that GPU offline;
- on a GPU, the override changes choices, not the hardware: a feature the GPU lacks stays
  off (no TMA path on an A100 named ``sm90``) and the shared memory is the smaller of the
  two, so the kernels still run. On an H100 every other profile is within reach, which is
  how the lead runs the test suite as an A100 or an L4 would choose.

A GPU that is not NVIDIA's (ROCm: ``torch.version.hip``) never takes an NVIDIA-only path,
whatever its capability numbers say (an MI300 reports 9.4).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

# Without a GPU the kernels run under Triton's interpreter on CPU tensors (the package's
# __init__ chooses it before triton is imported).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

PROFILE_VARIABLE = "STEPKERNELS_DEVICE_PROFILE"
KB = 1024


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str  # a profile's key ("sm80"), "interpreter", or the GPU's own name
    vendor: str  # "nvidia", "amd" or "none" (the interpreter)
    capability: tuple[int, int]  # (0, 0) under the interpreter
    sm_count: int
    shared_memory: int  # bytes one program may use, opted in: Triton's launch limit
    bf16: bool  # bf16 arithmetic in hardware (tensor cores from sm_80)
    examples: str = ""  # GPUs of the class
    registers: int = 64 * KB  # 32-bit registers a program (and an SM) may use
    max_registers_per_thread: int = 255

    @property
    def gpu(self) -> bool:
        """Choose for a GPU? False for the interpreter's own profile only: under the
        interpreter with an override, the rules choose as on the GPU named."""
        return self.vendor != "none"

    @property
    def nvidia(self) -> bool:
        return self.vendor == "nvidia"

    @property
    def tma(self) -> bool:
        """Tensor descriptors in hardware and wgmma: chapter 07's path. sm_90 only: sm_100
        has TMA too, but our descriptor kernels have not been checked there."""
        return self.nvidia and self.capability[0] == 9

    @property
    def fp8(self) -> bool:
        """fp8 (e4m3) tensor-core products: sm_89 and later. The interpreter emulates it."""
        return self.vendor == "none" or (self.nvidia and self.capability >= (8, 9))

    def within(self, real: DeviceProfile) -> DeviceProfile:
        """This profile's choices on the ``real`` GPU: its SM count and name, but no more
        shared memory and no feature that ``real`` lacks, and ``real``'s vendor."""
        capability = min(self.capability, real.capability)
        if real.vendor != self.vendor:  # not NVIDIA's: no NVIDIA-only path at all
            capability = (0, 0)
        return dataclasses.replace(
            self,
            vendor=real.vendor,
            capability=capability,
            shared_memory=min(self.shared_memory, real.shared_memory),
            bf16=self.bf16 and real.bf16,
        )


PROFILES = {
    profile.name: profile
    for profile in (
        DeviceProfile("sm80", "nvidia", (8, 0), 108, 163 * KB, True, "A100"),
        DeviceProfile("sm86", "nvidia", (8, 6), 72, 99 * KB, True, "A10, RTX 3090"),
        DeviceProfile("sm89", "nvidia", (8, 9), 58, 99 * KB, True, "L4, RTX 4090"),
        DeviceProfile("sm90", "nvidia", (9, 0), 132, 227 * KB, True, "H100 SXM"),
    )
}
# No GPU: the rules take small grids (a persistent loop still takes several turns) and the
# H100's shared memory, which the chapters were measured on; nothing is allocated there.
INTERPRETER = DeviceProfile("interpreter", "none", (0, 0), 4, 227 * KB, True)


@functools.cache
def hardware() -> DeviceProfile | None:
    """The GPU the kernels run on, as found; None under the interpreter."""
    if not ON_GPU:
        return None
    index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    shared = getattr(properties, "shared_memory_per_block_optin", 0)
    try:  # the limit Triton itself checks at launch
        from triton.compiler import max_shared_mem

        shared = max_shared_mem(index)
    except Exception:  # an older or other driver: torch's figure
        pass
    return DeviceProfile(
        name=properties.name,
        vendor="amd" if torch.version.hip else "nvidia",
        capability=(properties.major, properties.minor),
        sm_count=properties.multi_processor_count,
        shared_memory=int(shared or 48 * KB),
        bf16=torch.cuda.is_bf16_supported(including_emulation=False),
    )


def named_profile(name: str) -> DeviceProfile:
    """The profile ``name`` (``sm80``...), refusing one that does not exist."""
    if name not in PROFILES:
        raise ValueError(
            f"{PROFILE_VARIABLE}={name!r} names no device profile: choose one of "
            f"{', '.join(PROFILES)} (or unset it to use the device found)"
        )
    return PROFILES[name]


@functools.cache
def profile() -> DeviceProfile:
    """The device the launch rules choose for: the override if one is set (within what the
    GPU found can do), else the GPU found, else the interpreter's."""
    chosen, real = os.environ.get(PROFILE_VARIABLE), hardware()
    if chosen:
        named = named_profile(chosen)
        return named if real is None else named.within(real)
    return real or INTERPRETER


def describe(device: DeviceProfile | None = None) -> str:
    """One line for logs and test headers: which profile the rules choose for."""
    device = device or profile()
    major, minor = device.capability
    return (
        f"{device.name} ({device.vendor}, sm_{major}{minor}, {device.sm_count} SMs, "
        f"{device.shared_memory // KB} KB shared memory a program, "
        f"bf16 {'yes' if device.bf16 else 'no'})"
    )
