"""What the torch peers of the GPU benchmark (dense_baseline.py, int4_peer.py) share with bench.ts:
the Kimi K2 shapes, the token counts, and CUDA-event timing."""
import torch

SHAPES = [(4096, 7168), (7168, 2048), (18432, 7168), (7168, 18432)]  # N x K, bench.ts's SHAPES
# the layers Kimi K2 keeps in bf16 (one tensor-parallel rank where split): bench.ts's FLOAT_SHAPES
FLOAT_SHAPES = [(1536, 7168), (576, 7168), (1536, 1536), (7168, 1024), (4608, 7168), (7168, 2304), (20480, 7168)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048]  # 512 and 2048: prefill
REPS = 20
# weights rotate over copies of at least this many bytes, so L2 (50 MB on H200) never holds them
ROTATE_BYTES = 240_000_000


def timed(fn, reps):
    """Median over 5 batches of `reps` calls of fn(r) (r = the call's index, to rotate weight copies), in ms per call."""
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
