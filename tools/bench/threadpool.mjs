// As the kdtree CLI does (packages/cli/src/threadpool.ts): libuv threads = cores unless set.
import { availableParallelism } from 'node:os';

process.env.UV_THREADPOOL_SIZE ??= String(Math.min(Math.max(availableParallelism(), 2), 16));
