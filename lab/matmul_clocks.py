"""Is the spread of large matrix products run to run the GPU's clock? Time them with its state.

Run on a GPU from the repository root (``PYTHONPATH=src``)::

    python lab/matmul_clocks.py [--rounds 3]

Chapter 04 recorded our bf16 8,192³ product anywhere between 588 and 692 TFLOP/s from one run
to the next. Here ours and cuBLAS's, fp16 and bf16, take turns for a few rounds; each timing is
sampled by ``bench.gpu_state`` (nvidia-smi every 20 ms): the busy SM clock, power and the
clock-event reasons reported (0x4: software power cap) print beside the rate.
"""

import argparse

from stepkernels.lessons import bench
from stepkernels.ops.matmul import matmul
from stepkernels.runtime import core
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=8192)
    args = parser.parse_args()
    if not core.ON_GPU:
        print("needs a GPU: the clocks are the question")
        return
    n = args.size
    print(f"{n}³ products; clock MHz median (min) while busy, power W median / max, reasons")
    for dtype in (torch.bfloat16, torch.float16):
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in "ab")
        for round_ in range(args.rounds):
            calls = {"triton": lambda a=a, b=b: matmul(a, b), "torch": lambda a=a, b=b: a @ b}
            for name, fn in calls.items():
                with bench.gpu_state(interval_ms=20) as state:
                    ms = bench.measure_ms(fn)[0]
                rate = bench.per_time(2 * n**3, ms, "TFLOP/s")
                clock, power = state.get("sm_clock_mhz", {}), state.get("power_w", {})
                print(f"{str(dtype)[6:]:>8} round {round_} {name:>6}: {rate:6.1f} TFLOP/s | "
                      f"{clock.get('median', 0):6.0f} ({clock.get('min', 0):4.0f}) MHz | "
                      f"{power.get('median', 0):5.0f} / {power.get('max', 0):5.0f} W | "
                      f"{' '.join(state.get('clock_event_reasons', [])) or '-'}")  # fmt: skip


if __name__ == "__main__":
    main()
