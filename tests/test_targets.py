"""Every launch of every operation fits the GPUs learners have, checked without them.

``tools/check_targets.py`` records the launches the public operations make over
representative shapes and dtypes under the interpreter, with the launch rules choosing as on
sm_80 (A100), sm_86 (A10, RTX 3090), sm_89 (L4, RTX 4090) and sm_90 (H100), and compiles
each for that GPU with Triton's compiler: its shared memory and registers must fit. Compiled
results are kept in build/targets/, so only launches whose kernel or rule changed compile
again (a cold run compiles every one: see the tool's docstring).
"""

import concurrent.futures
import os
from pathlib import Path
import sys

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_targets  # noqa: E402

PROFILES = tuple(check_targets.TARGETS)


# Compiling every launch takes about an hour on 2 cores with an empty build/targets/ (a
# fresh clone, CI): `make targets` runs the compiled checks (STEPKERNELS_TARGETS=1); `make
# test` records the launches (seconds) and checks what the records say.
COMPILE = os.environ.get("STEPKERNELS_TARGETS") == "1"


@pytest.fixture(scope="module")
def launches():
    with concurrent.futures.ThreadPoolExecutor(len(PROFILES)) as pool:
        return dict(zip(PROFILES, pool.map(check_targets.record, PROFILES), strict=True))


@pytest.fixture(scope="module")
def results(launches):
    if not COMPILE:
        pytest.skip("compiles every launch for 4 GPUs (an hour cold): `make targets`")
    each = max(1, (os.cpu_count() or 1) // len(PROFILES))
    compiled = lambda p: check_targets.compile_launches(launches[p], p, each)
    with concurrent.futures.ThreadPoolExecutor(len(PROFILES)) as pool:
        return dict(zip(PROFILES, pool.map(compiled, PROFILES), strict=True))


@pytest.mark.parametrize("profile", PROFILES)
def test_every_launch_fits_the_gpu(results, profile):
    assert len(results[profile]) > 100  # the workload ran: every operation launched
    broken = [
        f"{check_targets.launch_summary(r)}: {'; '.join(check_targets.problems(r, profile))}"
        for r in results[profile]
        if check_targets.problems(r, profile)
    ]
    assert not broken, "\n".join(broken)


def test_every_kernel_is_exercised(launches):
    # A kernel no exercise launches is checked on no GPU: a new operation needs its
    # exercise in tools/target_exercises.py.
    launched = {r["kernel"] for rs in launches.values() for r in rs}
    missing = sorted(check_targets.package_kernels() - launched)
    assert not missing, f"launched by no exercise in tools/target_exercises.py: {missing}"


def kernels(results, profile, name):
    return [r for r in results[profile] if check_targets.kernel_name(r) == name]


def test_the_launches_follow_the_profile(launches):
    # The Hopper path only where the profile has TMA; fp8 from sm_89.
    assert not kernels(launches, "sm80", "matmul_tma_kernel")
    assert not kernels(launches, "sm86", "matmul_tma_kernel")
    assert kernels(launches, "sm90", "matmul_tma_kernel")
    dtypes = lambda profile: {a.get("tensor") for r in kernels(launches, profile, "matmul_kernel")
                              for a in r["args"] if isinstance(a, dict)}  # fmt: skip
    assert "float8_e4m3fn" not in dtypes("sm80") | dtypes("sm86")
    assert "float8_e4m3fn" in dtypes("sm89")
    # Persistent grids by the profile's SM count: chapter 07's NUM_SMS on sm_90.
    assert {r["kwargs"]["NUM_SMS"] for r in kernels(launches, "sm90", "matmul_tma_kernel")} == {132}


def test_the_compiled_launches_use_hopper_instructions_only_on_hopper(results):
    # Attention's host descriptors before sm_90: Triton reads the tiles with plain loads
    # (no TMA copy in the PTX, which problems() holds against every launch); on sm_90
    # with TMA copies, and chapter 07's kernel with TMA copies and wgmma.
    for r in kernels(results, "sm90", "attention_forward_kernel"):
        assert "cp.async.bulk.tensor" in r["hopper"], check_targets.launch_summary(r)
    for r in kernels(results, "sm90", "matmul_tma_kernel"):
        if r["args"][0]["tensor"] in ("float16", "bfloat16"):
            assert {"cp.async.bulk.tensor", "wgmma.mma_async"} <= set(r["hopper"])
    for profile in ("sm80", "sm86", "sm89"):
        assert all(not r["hopper"] for r in results[profile] if "error" not in r)


def test_attention_fits_by_its_estimate(results):
    # Attention's launches are chosen by their estimated shared memory: the estimate is an
    # upper bound of what Triton allocates (the check's problems() holds every launch to
    # it), and on sm_90, where tiles stream through TMA, it is within 2 KB of it.
    for profile in PROFILES:
        for kernel in ("attention_forward_kernel", "attention_query_grad_kernel",
                       "attention_key_grads_kernel"):  # fmt: skip
            launched = kernels(results, profile, kernel)
            assert launched and all(r["estimate"] is not None for r in launched)
    for r in kernels(results, "sm90", "attention_forward_kernel"):
        if r["args"][0]["descriptor"]["tensor"] != "float32":  # exact fp32: no wgmma
            assert r["estimate"] - r["shared"] <= 2048, check_targets.launch_summary(r)


def test_the_check_catches_a_launch_that_does_not_fit(results):
    # tf32 attention with the H100's 16-bit launch (64 x 64 blocks, 3 stages) needs
    # 208 KB on sm_80: more than an A100's 163 KB. The check says so.
    fp32 = [r for r in kernels(results, "sm80", "attention_forward_kernel")
            if r["args"][0]["descriptor"]["tensor"] == "float32"
            and r["kwargs"]["PRECISION"] == "tf32" and r["kwargs"]["HEAD_DIM"] == 128]  # fmt: skip
    launch = {k: fp32[0][k] for k in ("kernel", "args", "kwargs")}
    launch["kwargs"] = {**launch["kwargs"], "BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3}
    q, k, v, o, *rest = launch["args"]  # descriptors of [1, 1, block, D] tiles
    tiles = [{**t, "block": [1, 1, 64, 128]} for t in (q, k, v, o)]
    launch["args"] = [*tiles, *rest]
    (compiled,) = check_targets.compile_launches([launch], "sm80", 1)
    found = check_targets.problems(compiled, "sm80")
    assert any("shared memory" in problem and "> 166912 B" in problem for problem in found)
