/**
 * What every tensor-parallel rank other than rank 0 does, whether it is a worker thread
 * (tp-worker.ts) or a process (tp-process.ts): loads its shard of the model on its own cpu
 * backend, reports it loaded, then runs each command rank 0 sends through its Runner. Only the
 * link to rank 0 (a message port and shared memory, or a relay thread and a socket) differs.
 */
import { createBackend } from '@kdtree/cuda';
import { HostCollective, type Collective, type HostTransport } from './collective.js';
import { NcclCollective } from './nccl-collective.js';
import { DeviceModel } from './model.js';
import { openModel } from './shard-source.js';
import { Runner, type RankCommand } from './runner.js';
import { ncclIdBytes, rankDevice, type RankSetup, type TpFault } from './tp.js';

/** A rank's connection to rank 0. */
export interface RankLink {
  readonly transport: HostTransport;
  /** One more part of the shard loaded (rank 0 watches for loads that stop moving). */
  progress(): void;
  /** The load finished: `error` when it threw. */
  loaded(error?: string): void;
  /** Calls `on` with each of rank 0's commands, in order. */
  onCommand(on: (command: RankCommand | { op: 'close' }) => void): void;
  /** Ends the group: this rank `what`; then ends the rank. */
  fail(what: string): void;
  /** The rank is done (after close): lets it end. */
  closed(): void;
}

/** The injected fault, where and as the tests ask. */
export function inject(fault: TpFault): void {
  if (fault.kind === 'throw') throw new Error(`injected fault at ${fault.at === 'load' ? 'load' : `collective ${fault.at}`}`);
  if (fault.kind === 'exit') process.exit(3);
  // a rank that stops answering: it sleeps in short waits, so terminate() still ends it
  const cell = new Int32Array(new SharedArrayBuffer(4));
  for (;;) Atomics.wait(cell, 0, 0, 50);
}

/** The collective hook that injects `fault` at its collective. */
export function faultHook(fault: TpFault | undefined): ((call: number) => void) | undefined {
  return fault && fault.at !== 'load' ? (call) => call === fault.at && inject(fault) : undefined;
}

function describe(command: RankCommand): string {
  return command.op === 'step' ? `a ${command.step.kind} step` : command.op;
}

/** Where a rank runs on the cuda backend: its device (its local rank) and rank 0's NCCL id. */
export interface RankDevice {
  localRank: number;
  ncclId?: string;
  timeoutMs: number;
}

export async function serveRank(rank: number, setup: RankSetup, link: RankLink, fault: TpFault | undefined, where?: RankDevice): Promise<void> {
  let runner: Runner | undefined;
  let model: DeviceModel | undefined;
  let collective: Collective | undefined;
  const world = link.transport.world;
  try {
    if (fault?.at === 'load') inject(fault);
    const cuda = setup.backend === 'cuda';
    const b = cuda ? createBackend({ backend: 'cuda', device: where?.localRank ?? 0 }) : createBackend({ backend: 'cpu' });
    if (cuda) rankDevice(where?.localRank ?? 0, (where?.localRank ?? 0) + 1, b.loaded.probe?.deviceCount ?? 0);
    const source = await openModel(setup.model, { config: setup.config, shard: { rank, world } });
    try {
      // NCCL's init blocks until every rank has called it; rank 0 calls it once every rank has
      // connected to its relay (this one has: the relay connected before the load began)
      collective = cuda
        ? new NcclCollective(b, { rank, world, id: ncclIdBytes(where?.ncclId), timeoutMs: where?.timeoutMs ?? 20_000, gatherFloats: setup.rows * Math.ceil(source.config.vocabSize / world) })
        : new HostCollective(b, link.transport);
      model = await DeviceModel.load(b, source, { rows: setup.rows, activations: setup.activations, shard: { rank, world }, collective, onProgress: () => link.progress() });
    } finally {
      await source.close();
    }
    runner = new Runner(b, model, setup.cacheTokens, setup.cacheDtype, setup.prefillChunk);
    runner.useStepBuffers(runner.treeBuffers(setup.nodes), runner.own(b.zeros('f32', [setup.maxDepth, model.config.vocabSize])));
  } catch (error) {
    runner?.dispose();
    model?.dispose();
    if (collective instanceof NcclCollective) collective.close();
    link.loaded(error instanceof Error ? error.message : String(error));
    return;
  }
  const r = runner;
  const m = model;
  let closing = false;
  link.onCommand((command) => {
    if (closing) return;
    if (command.op === 'close') {
      closing = true;
      r.dispose();
      m.dispose();
      if (collective instanceof NcclCollective) collective.close();
      link.closed();
      return;
    }
    try {
      // a step, prefill or teacher-forced pass under the collective's watchdog: a deadline per forward pass
      const passes = r.passes(command);
      if (passes > 0) r.guarded(() => r.execute(command), passes);
      else r.execute(command);
    } catch (error) {
      closing = true;
      link.fail(`threw during ${describe(command)}: ${error instanceof Error ? error.message : String(error)}`);
    }
  });
  link.loaded();
}
