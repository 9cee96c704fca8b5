#!/usr/bin/env python3
"""The peer of the reference benchmark: numpy's f32 matmul (OpenBLAS) on the shapes of the core
matmul, x[M, K] @ w[N, K]^T. Prints one line per shape: M N K median-seconds."""
import sys
import time

import numpy as np

reps = int(sys.argv[1])
for spec in sys.argv[2:]:
    m, n, k = map(int, spec.split("x"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    x @ w.T
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x @ w.T
        times.append(time.perf_counter() - t)
    print(m, n, k, sorted(times)[len(times) // 2])
