#!/usr/bin/env python3
"""The W4A16 peer of the benchmark, on the GPU host: torch's int4 weight-only GEMM
(`torch._weight_int4pack_mm`, the tinygemm kernel that gpt-fast and torchao's int4 weight-only
path run), at group 32 on the same shapes and M values as bench.ts, timed like dense_baseline.py.

Each shape is validated before it is timed: random codes q in [0, 15] and bf16 scales (zero points
0, so tinygemm's w = (q - 8) * scale + zero is the symmetric format of docs/ and compressed-tensors)
against x . ((q - 8) * scale)^T computed in f32 by torch; a relative error above 1e-2 (bf16 output)
fails the shape instead of timing it. Its weight stream is 0.625 bytes per weight (scale and zero
as a bf16 pair per group) against our 0.5625.

Writes JSON to argv[1]: {"kernel", "torch", "group", "shapes": {"NxK": {M: ms}}, "validation":
{"NxK": rel}}, or {"kernel", "torch", "error"} when this torch has no usable int4 kernel (the
benchmark then prints '-' in the peer's column).
"""
import json
import sys

import torch

from peers import MS, REPS, ROTATE_BYTES, SHAPES, timed

GROUP = 32
INNER_K_TILES = 8  # gpt-fast's choice; K must be a multiple of 16 * INNER_K_TILES (all shapes here are)
KERNEL = "torch._weight_int4pack_mm (tinygemm)"


def pack(codes):
    """codes uint8 [N, K] in [0, 15] -> tinygemm's packed int32 layout: torch >= 2.5 takes two codes
    per byte ([N, K / 2] uint8, even k in the high nibble); older releases take int32 [N, K]."""
    try:
        return torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(), INNER_K_TILES)
    except RuntimeError:
        return torch._convert_weight_to_int4pack(codes.to(torch.int32).contiguous(), INNER_K_TILES)


def quantized(n, k):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // GROUP, device="cuda") * 0.02 + 0.001).to(torch.bfloat16)
    # [K / G, N, 2]: (scale, zero) per group and row
    scales_and_zeros = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).contiguous()
    return codes, scales, pack(codes), scales_and_zeros


def main():
    out = {"kernel": KERNEL, "torch": torch.__version__, "group": GROUP, "shapes": {}, "validation": {}}
    torch.manual_seed(0)
    try:
        for n, k in SHAPES:
            codes, scales, packed, sz = quantized(n, k)
            x = torch.randn(max(MS), k, dtype=torch.bfloat16, device="cuda")
            w = (codes.float() - 8) * scales.float().repeat_interleave(GROUP, dim=1)
            ref = x[:4].float() @ w.t()
            got = torch._weight_int4pack_mm(x[:4].contiguous(), packed, GROUP, sz).float()
            rel = ((got - ref).norm() / ref.norm()).item()
            out["validation"][f"{n}x{k}"] = rel
            if not rel <= 1e-2:
                raise RuntimeError(f"{KERNEL} on {n}x{k}: relative error {rel:.3g} against the f32 reference (expected <= 1e-2)")
            del codes, scales, w, ref
            copies = max(2, -(-ROTATE_BYTES // (n * k // 2)))
            weights = [(packed, sz)] + [quantized(n, k)[2:] for _ in range(copies - 1)]
            row = {}
            for m in MS:
                xm = x[:m].contiguous()
                row[m] = timed(lambda r: torch._weight_int4pack_mm(xm, weights[r % copies][0], GROUP, weights[r % copies][1]), REPS)
            out["shapes"][f"{n}x{k}"] = row
            del weights
            print(f"int4 peer {n}x{k} (rel {rel:.1e}): " + ", ".join(f"M={m} {row[m] * 1000:.1f}us" for m in MS), flush=True)
    except (RuntimeError, AttributeError) as e:  # no kernel for this device or torch, or a failed validation
        out = {"kernel": KERNEL, "torch": torch.__version__, "error": str(e).splitlines()[0]}
        print(f"int4 peer: {out['error']}", file=sys.stderr)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
