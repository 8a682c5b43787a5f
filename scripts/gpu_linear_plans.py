"""The projections' batch-invariant row plans on this GPU at the default model's shapes (kernels/linear.py),
bf16 and fp32, and what a 16-row call (a 16-node verify) costs under each chosen plan against one row
per call (the fallback where no plan is exact). Run by scripts/gpu_check.sh tests."""
import torch

from specjet.kernels.linear import _PLANS, choose_plan, pack_weight

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))


def time_ms(fn, reps=200):
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


for dtype in (torch.bfloat16, torch.float32):
    for i, o in SHAPES:
        w = torch.randn(i, o, device="cuda", dtype=dtype) * 0.05
        packed = pack_weight(w)
        x = torch.randn(16, i, device="cuda", dtype=dtype)
        _, one_row = choose_plan(w, None, False, [])  # no candidate: the one-row-per-call fallback
        with torch.inference_mode():
            chosen, fallback = time_ms(lambda: packed(x)), time_ms(lambda: one_row(x))
        print(f"{str(dtype):15} {i:5d} x {o:5d}: plan (min_rows {packed.min_rows}, max_rows {packed.max_rows}); "
              f"16 rows {chosen:.3f} ms, one row per call {fallback:.3f} ms")
print("linear plans (in, out, dtype, bias, threads, blocked, device) -> (hint, min_rows, max_rows):", _PLANS)
