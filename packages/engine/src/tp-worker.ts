/**
 * A tensor-parallel worker rank (a worker thread started by TpGroup) over shared memory: see
 * tp-rank.ts for what it does. Any error marks the group failed (every rank waiting at a barrier
 * wakes and stops) and ends this thread.
 */
import { parentPort, workerData } from 'node:worker_threads';
import type { RankCommand } from './runner.js';
import { SharedMemoryTransport } from './shared-memory-transport.js';
import { faultHook, serveRank } from './tp-rank.js';
import type { RankMessage, RankWorkerData } from './tp.js';

const data = workerData as RankWorkerData;
const port = parentPort!;
const { rank } = data;
let closing = false;
const transport = new SharedMemoryTransport(data.memory, rank, data.timeoutMs, faultHook(data.fault));

// an exit that skipped the handlers below (process.exit anywhere) still ends the group at once
process.on('exit', (code) => {
  if (!closing) transport.fail(rank, `exited (code ${code})`);
});

void serveRank(
  rank,
  data.setup,
  {
    transport,
    progress: () => transport.progress(),
    loaded(error) {
      if (error === undefined) {
        port.postMessage({ type: 'ready' } satisfies RankMessage);
        return;
      }
      closing = true;
      port.postMessage({ type: 'error', message: error } satisfies RankMessage);
      port.close();
    },
    onCommand: (on) => port.on('message', (command: RankCommand | { op: 'close' }) => on(command)),
    fail(what) {
      transport.fail(rank, what);
      closing = true;
      process.exit(1);
    },
    closed() {
      closing = true;
      port.close();
    },
  },
  data.fault,
);
