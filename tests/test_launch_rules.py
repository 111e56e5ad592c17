"""Launch rules that read the device profile choose what fits each GPU: attention's blocks
and stages, layer norm's stages. Evaluated here for each profile in-process (the profile
patched where the rule reads it); tools/check_targets.py compiles what they choose."""

import dataclasses

import pytest
from stepkernels.ops import attention, attention_launches, layer_norm
from stepkernels.runtime.device import PROFILES

KB = 1024
T4 = dataclasses.replace(PROFILES["sm80"], name="t4", capability=(7, 5), shared_memory=64 * KB)
DEVICES = {**PROFILES, "t4": T4}


@pytest.fixture
def on(monkeypatch):
    """``on(name)``: the launch rules choose as on that device, as on a GPU."""

    def choose_for(name):
        device = DEVICES[name]
        for module in (attention_launches, layer_norm):
            monkeypatch.setattr(module, "profile", lambda: device)
        monkeypatch.setattr(attention, "ON_GPU", True)
        attention.default_launches.cache_clear()
        layer_norm.forward_config.cache_clear()
        layer_norm.backward_config.cache_clear()
        return device

    yield choose_for
    attention.default_launches.cache_clear()
    layer_norm.forward_config.cache_clear()
    layer_norm.backward_config.cache_clear()


measured = attention.default_launches.__wrapped__.measured  # the chapter's table, unfitted
CASES = [(d, size, causal) for d in (16, 32, 64, 128) for size in (2, 4) for causal in (False, True)]


@pytest.mark.parametrize("name", DEVICES)
def test_attention_launches_fit_the_device(on, name):
    device = on(name)
    for head_dim, size, causal in CASES:
        for launch, kernel in zip(
            attention.default_launches(head_dim, size, causal), attention_launches.TILE_ROWS, strict=True
        ):
            assert attention_launches.shared_bytes(launch, kernel, head_dim, size) <= device.shared_memory
            assert min(launch.block_m, launch.block_n) >= 16 and launch.num_stages >= 1


def test_attention_on_the_h100_is_its_sweep(on):
    on("sm90")
    for head_dim, size, causal in CASES:
        assert attention.default_launches(head_dim, size, causal) == measured(head_dim, size, causal)


def test_attention_fp32_backward_is_made_to_fit_99_kb(on):
    # The H100's fp32 launches of the backward take up to 160 KB before Hopper (the
    # compiled dK, dV kernel: 164,096 bytes for sm_80 with tf32, 139,520 for sm_86 in
    # exact fp32): over an RTX 3090's or L4's 99 KB.
    on("sm86")
    h100 = measured(128, 4, False)
    chosen = attention.default_launches(128, 4, False)
    for kernel, before, after in zip(attention_launches.TILE_ROWS, h100, chosen, strict=True):
        if kernel != "forward":
            assert attention_launches.shared_bytes(before, kernel, 128, 4) > 99 * KB
            assert attention_launches.shared_bytes(after, kernel, 128, 4) <= 99 * KB


def test_attention_sixteen_bit_is_the_h100s_on_an_a100(on):
    on("sm80")
    for head_dim in (64, 128):
        for causal in (False, True):
            chosen = attention.default_launches(head_dim, 2, causal)
            assert chosen == measured(head_dim, 2, causal)


def stages_bytes(config, n_cols, itemsize, param_bytes):
    """Shared memory the forward's loads in flight take: NUM_STAGES - 1 blocks."""
    block = config["BLOCK_N"]
    per_stage = config["ROWS_PER_PROGRAM"] * block * itemsize + block * param_bytes
    return (config["NUM_STAGES"] - 1) * per_stage


@pytest.mark.parametrize("name", DEVICES)
@pytest.mark.parametrize("itemsize, param_bytes", [(2, 0), (2, 4), (2, 8), (4, 8)])
def test_layer_norm_forward_stages_fit_the_device(on, name, itemsize, param_bytes):
    device = on(name)
    for n_cols in (384, 1000, 2048, 4096, 8192, 16384):
        config = layer_norm.forward_config(n_cols, 4096, None, itemsize, param_bytes)
        if "NUM_STAGES" in config:
            assert stages_bytes(config, n_cols, itemsize, param_bytes) <= device.shared_memory - KB


def test_layer_norm_forward_keeps_the_h100s_choice(on):
    # Rows of 32 KB with fp32 weight and bias beside 16-bit x: 160 KB in flight at 2 stages.
    # The H100 keeps its 2 stages; an A10's 99 KB take 1 (fp16 weight and bias: 2).
    on("sm90")
    assert layer_norm.forward_config(16384, 256, None, 2, 8)["NUM_STAGES"] == 2
    on("sm86")
    assert layer_norm.forward_config(16384, 256, None, 2, 8)["NUM_STAGES"] == 1
    assert layer_norm.forward_config(16384, 256, None, 2, 4)["NUM_STAGES"] == 2


@pytest.mark.parametrize("name", DEVICES)
def test_layer_norm_backward_stages_fit_the_device(on, name):
    device = on(name)
    for itemsize in (2, 4):
        for n_cols in (384, 1024, 2048, 4096, 8192):
            config = layer_norm.backward_config(n_cols, 16384, None, None, itemsize)
            in_flight = config["NUM_STAGES"] * 2 * config["BLOCK_N"] * itemsize  # x and dy
            budget = min(layer_norm.BACKWARD_STAGE_BYTES, device.shared_memory - KB)
            assert in_flight <= budget or config["NUM_STAGES"] == 1  # 1: none in flight
    if name in PROFILES:  # 96 KB or more: as on the H100
        assert layer_norm.backward_config(8192, 16384, None, None, 2)["NUM_STAGES"] == 3
