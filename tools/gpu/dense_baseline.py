#!/usr/bin/env python3
"""The dense bf16 peer of the W4A16 and gemm benchmarks, on the GPU host: torch's bf16 linear (cuBLAS)
on the same shapes and M values, timed with CUDA events over rotating weight copies (so L2 never holds
them), plus a device-to-device copy bandwidth measured the same way. Writes JSON to argv[1].
"""
import json
import sys

import torch

from peers import FLOAT_SHAPES, MS, REPS, ROTATE_BYTES, SHAPES, timed

torch.manual_seed(0)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_(0, 255)
dst = torch.empty_like(src)
ms = timed(lambda r: dst.copy_(src), 5)
out["copy_gbps"] = 2 * src.numel() / (ms * 1e-3) / 1e9
del src, dst
for n, k in SHAPES + FLOAT_SHAPES:
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
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
