#!/usr/bin/env python3
"""The dense bf16 peer of the W4A16 benchmark, on the GPU host: torch's bf16 linear (cuBLAS) on the
same shapes and M values, timed with CUDA events over rotating weight copies (so L2 never holds
them), plus a device-to-device copy bandwidth measured the same way. Writes JSON to argv[1].
"""
import json
import sys

import torch

SHAPES = [(4096, 7168), (7168, 2048), (18432, 7168), (7168, 18432)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048]  # 512 and 2048: prefill
REPS = 20


def timed(fn, reps):
    for _ in range(3):
        fn(0)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for r in range(reps):
            fn(r)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


torch.manual_seed(0)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_(0, 255)
dst = torch.empty_like(src)
ms = timed(lambda r: dst.copy_(src), 5)
out["copy_gbps"] = 2 * src.numel() / (ms * 1e-3) / 1e9
del src, dst
for n, k in SHAPES:
    copies = max(2, -(-240_000_000 // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(max(MS), k, dtype=torch.bfloat16, device="cuda")
    row = {}
    for m in MS:
        xm = x[:m].contiguous()
        row[m] = timed(lambda r: torch.nn.functional.linear(xm, weights[r % copies]), REPS)
    out["shapes"][f"{n}x{k}"] = row
    del weights
    print(f"dense bf16 {n}x{k}: " + ", ".join(f"M={m} {row[m] * 1000:.1f}us" for m in MS), flush=True)
print(f"torch device-to-device copy: {out['copy_gbps']:.0f} GB/s")
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
