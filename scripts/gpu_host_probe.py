"""The GPU machine's host speed, printed at the start of every scripts/gpu_check.sh call: a GPU decode or
speculative iteration of the default model is bound by host work (Python, launches, syncs), so two sessions'
GPU figures compare only when their hosts do. Three numbers, medians of 5 (about 2 s in all):
a pure-Python loop, one small CUDA kernel's launch, and one launch-and-sync round trip."""
from __future__ import annotations

import json
import statistics
import time

import torch


def median_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def python_loop(n: int = 1_000_000) -> None:
    total = 0
    for i in range(n):
        total += i & 7


def main() -> None:
    report = {"python_loop_1e6_ms": round(1000 * median_of(python_loop), 1)}
    if torch.cuda.is_available():
        x = torch.ones(64, device="cuda")
        torch.cuda.synchronize()

        def launches(n: int = 2000) -> None:
            for _ in range(n):
                x.add_(1)
            torch.cuda.synchronize()

        def round_trips(n: int = 500) -> None:
            for _ in range(n):
                x.add_(1)
                x[0].item()

        launches()
        report["launch_us"] = round(1e6 * median_of(launches) / 2000, 2)
        report["launch_and_sync_us"] = round(1e6 * median_of(round_trips) / 500, 2)
    print("host probe:", json.dumps(report))


if __name__ == "__main__":
    main()
