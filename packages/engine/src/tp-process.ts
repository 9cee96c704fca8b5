/**
 * A tensor-parallel rank as a process (forked by TpGroup with `tpRanks: 'processes'`): see
 * tp-rank.ts for what it does. Its collectives go over TCP to rank 0 through a relay thread
 * (socket-transport.ts). It ends itself when rank 0 goes away (the IPC channel or the socket
 * closes), so no rank outlives the engine that started it.
 */
import { Worker } from 'node:worker_threads';
import type { RankCommand } from './runner.js';
import type { RelayData, RelayMessage, RelayRequest } from './socket-relay.js';
import { relayMemory, SocketTransport } from './socket-transport.js';
import { faultHook, serveRank } from './tp-rank.js';
import { builtModule, type RankProcessData } from './tp.js';

const data = JSON.parse(process.env.KDTREE_TP_RANK ?? 'null') as RankProcessData | null;
if (data === null) throw new Error('tp-process: started without KDTREE_TP_RANK (TpGroup forks it)');
const { rank } = data;
const memory = relayMemory(data.world, data.slotFloats);
const relay = new Worker(builtModule('socket-relay.js'), { workerData: { memory, rank, timeoutMs: data.timeoutMs, host: data.host, port: data.port } satisfies RelayData });
const transport = new SocketTransport(memory, rank, faultHook(data.fault));
const post = (message: RelayRequest) => relay.postMessage(message);
/** Ends this rank once the relay has sent what it was given (or after a second regardless). */
const exitAfterSent = (code: number) => {
  relay.on('message', (m: RelayMessage) => m.type === 'sent' && process.exit(code));
  setTimeout(() => process.exit(code), 1000).unref();
};

process.on('disconnect', () => process.exit(1));
relay.on('error', () => process.exit(1));
// commands that come while the shard loads (a close, when rank 0's own load failed) wait for it
const early: (RankCommand | { op: 'close' })[] = [];
let onCommand: ((command: RankCommand | { op: 'close' }) => void) | undefined;
relay.on('message', (m: RelayMessage) => {
  if (m.type === 'lost') process.exit(1);
  if (m.type !== 'command') return;
  const command = m.command as RankCommand | { op: 'close' };
  if (onCommand) onCommand(command);
  else early.push(command);
});

void serveRank(
  rank,
  data.setup,
  {
    transport,
    progress: () => post({ type: 'progress' }),
    loaded(error) {
      if (error === undefined) return post({ type: 'ready' });
      exitAfterSent(1);
      post({ type: 'error', message: error });
    },
    onCommand(on) {
      onCommand = on;
      for (const command of early.splice(0)) on(command);
    },
    fail(what) {
      exitAfterSent(1);
      post({ type: 'fail', what });
    },
    closed: () => process.exit(0),
  },
  data.fault,
);
