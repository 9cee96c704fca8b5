#!/usr/bin/env python3
"""The peer of the quantize benchmark: the same INT4 algorithm as @kdtree/quant, vectorized in numpy.

Reads W (f32 [N, K], raw little-endian) from argv[1], quantizes it (minmax, group 32, bf16 scales)
once to warm up, then REPS times, writes packed codes and scale bits to argv[2] and argv[3], prints the median seconds.
"""
import sys
import time

import numpy as np

path, packed_out, scales_out, n, k, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
G, DIVISOR, QMIN, QMAX = 32, np.float32(7.5), -8, 7
w = np.fromfile(path, dtype=np.float32).reshape(n, k)


def quantize(w):
    wg = w.reshape(n, k // G, G)
    absmax = np.abs(wg).max(axis=-1)
    s = np.maximum(absmax / DIVISOR, np.float32(2.0**-23))
    s[absmax == 0] = np.float32(2.0**-7)
    bits = s.view(np.uint32)
    bf16 = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    s_eff = (bf16.astype(np.uint32) << 16).view(np.float32)
    q = np.clip(np.rint(wg / s_eff[..., None]), QMIN, QMAX).astype(np.int32) + 8
    u = q.reshape(n, k // 8, 8).astype(np.uint32)
    packed = u[..., 0]
    for i in range(1, 8):
        packed = packed | (u[..., i] << np.uint32(4 * i))
    return packed.view(np.int32), bf16


quantize(w)  # warm-up, as the JavaScript side gets
times = []
for _ in range(reps):
    t = time.perf_counter()
    packed, scales = quantize(w)
    times.append(time.perf_counter() - t)
packed.tofile(packed_out)
scales.tofile(scales_out)
print(sorted(times)[len(times) // 2])
