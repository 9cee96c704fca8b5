/**
 * A tensor-parallel worker rank (a worker thread started by TpGroup): loads its shard of the
 * model on its own cpu backend, then runs each command rank 0 sends through its Runner. Any error
 * marks the group failed (every rank waiting at a barrier wakes and stops) and ends this thread.
 */
import { parentPort, workerData } from 'node:worker_threads';
import { createBackend } from '@kdtree/cuda';
import { HostCollective } from './collective.js';
import { DeviceModel } from './model.js';
import { openModel } from './shard-source.js';
import { Runner, type RankCommand } from './runner.js';
import { SharedMemoryTransport } from './shared-memory-transport.js';
import type { RankMessage, RankWorkerData, TpFault } from './tp.js';

const data = workerData as RankWorkerData;
const port = parentPort!;
const { rank, setup } = data;
let closing = false;

/** The injected fault, where and as the tests ask. */
function inject(fault: TpFault): void {
  if (fault.kind === 'throw') throw new Error(`injected fault at ${fault.at === 'load' ? 'load' : `collective ${fault.at}`}`);
  if (fault.kind === 'exit') process.exit(3);
  // a rank that stops answering: it sleeps in short waits, so terminate() still ends it
  const cell = new Int32Array(new SharedArrayBuffer(4));
  for (;;) Atomics.wait(cell, 0, 0, 50);
}

const fault = data.fault;
const transport = new SharedMemoryTransport(data.memory, rank, data.timeoutMs, fault && fault.at !== 'load' ? (call) => call === fault.at && inject(fault) : undefined);

// an exit that skipped the handlers below (process.exit anywhere) still ends the group at once
process.on('exit', (code) => {
  if (!closing) transport.fail(rank, `exited (code ${code})`);
});

function describe(command: RankCommand): string {
  return command.op === 'step' ? `a ${command.step.kind} step` : command.op;
}

async function main(): Promise<void> {
  let runner: Runner | undefined;
  let model: DeviceModel | undefined;
  try {
    if (fault?.at === 'load') inject(fault);
    const b = createBackend({ backend: 'cpu' });
    const source = await openModel(setup.model, { config: setup.config, shard: { rank, world: transport.world } });
    try {
      model = await DeviceModel.load(b, source, { rows: setup.rows, activations: setup.activations, shard: { rank, world: transport.world }, collective: new HostCollective(b, transport), onProgress: () => transport.progress() });
    } finally {
      await source.close();
    }
    runner = new Runner(b, model, setup.cacheTokens, setup.cacheDtype, setup.prefillChunk);
    runner.useStepBuffers(runner.treeBuffers(setup.nodes), runner.own(b.zeros('f32', [setup.maxDepth, model.config.vocabSize])));
  } catch (error) {
    runner?.dispose();
    model?.dispose();
    closing = true;
    port.postMessage({ type: 'error', message: error instanceof Error ? error.message : String(error) } satisfies RankMessage);
    port.close();
    return;
  }
  const r = runner;
  const m = model;
  port.on('message', (command: RankCommand | { op: 'close' }) => {
    if (closing) return;
    if (command.op === 'close') {
      closing = true;
      r.dispose();
      m.dispose();
      port.close();
      return;
    }
    try {
      r.execute(command);
    } catch (error) {
      transport.fail(rank, `threw during ${describe(command)}: ${error instanceof Error ? error.message : String(error)}`);
      closing = true;
      process.exit(1);
    }
  });
  port.postMessage({ type: 'ready' } satisfies RankMessage);
}

void main();
