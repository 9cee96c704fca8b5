import { availableParallelism } from 'node:os';

// File reads run on libuv's thread pool (4 threads by default). For copies out of the page cache,
// threads beyond the core count only contend: on 2 cores, 2 threads read a KDTR bundle 1.2-1.5x
// faster than 4 (docs/benchmarks/format-read.md). The pool starts on first use, so this module is
// imported first, before anything does I/O. A user's own setting wins.
process.env.UV_THREADPOOL_SIZE ??= String(Math.min(Math.max(availableParallelism(), 2), 16));
