/**
 * Ranks that join rank 0 from elsewhere (another node, torchrun), and the cuda path's
 * orchestration as far as it runs without GPUs: the device of each local rank, the NCCL id's
 * handoff in the run's setup, and the refusals that name both numbers. (The kdtree run processes
 * over two nodes and under torchrun: packages/cli/src/tp-launch-cli.test.ts.)
 */
import { spawn } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { connect } from 'node:net';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { Worker } from 'node:worker_threads';
import { beforeAll, describe, expect, it } from 'vitest';
import { createBackend, KdtreeBackend } from '@kdtree/cuda';
import { writeSyntheticModel, type GoldenRecord } from '@kdtree/reference';
import { createEngine, launchPlans, RankFailure, startNodeRanks } from './index.js';
import type { RelayData, RelayMessage } from './socket-relay.js';
import { relayMemory } from './socket-transport.js';
import { frame, HELLO } from './relay-frames.js';
import { joinRun } from './tp-launch.js';
import { builtModule, ncclIdBytes, ncclIdHex, rankDevice, type RankJoinReply, type RankSetup } from './tp.js';
import { tempDir } from './test-support/models.js';
import { alive } from './test-support/processes.js';

const dir = tempDir('kdtree-tp-launch-');
let tiny = '';
let golden: GoldenRecord;

beforeAll(async () => {
  tiny = join(dir, 'tiny.kdtr');
  golden = await writeSyntheticModel(tiny, { preset: 'tiny', seed: 7 }, 'engine tp launch tests');
}, 120_000);

describe('the device of each local rank (cuda ranks)', () => {
  it('is the local rank, one device each', () => {
    expect([0, 1, 2, 3].map((r) => rankDevice(r, 4, 8))).toEqual([0, 1, 2, 3]);
    // node 1 of a 2 x 4 run: global ranks 4..7 are local ranks 0..3, devices 0..3 of that host
    expect(launchPlans({ tp: 4, nnodes: 2, nodeRank: 1, masterAddr: 'h0' }, {}).map((p) => rankDevice(p.localRank, 4, 4))).toEqual([0, 1, 2, 3]);
  });

  it('fewer devices than local ranks: refused naming both numbers', () => {
    expect(() => rankDevice(0, 4, 2)).toThrow('tp: 4 tensor-parallel ranks on this host need one CUDA device each (devices 0..3), but it has 2 (run at most --tp 2 per node, or more nodes)');
    expect(() => rankDevice(0, 2, 0)).toThrow(/need one CUDA device each \(devices 0\.\.1\), but it has 0$/);
  });

  it('the NCCL id travels as hex and back to its 128 bytes; anything else is refused', () => {
    const id = Uint8Array.from({ length: 128 }, (_, i) => (i * 29 + 3) & 255);
    expect([...ncclIdBytes(ncclIdHex(id))]).toEqual([...id]);
    expect(() => ncclIdBytes(undefined)).toThrow(/ncclId: expected rank 0's NCCL unique id as 256 hex digits, got none/);
    expect(() => ncclIdBytes('abc')).toThrow(/got 'abc'/);
  });

  it('createEngine on the cuda backend: one process per device, checked before anything loads', async () => {
    // a cuda backend as createEngine sees one (its kind and device count); no GPU is touched before the checks
    const cpu = createBackend({ backend: 'cpu' });
    const cuda = (deviceCount: number) => Object.assign(Object.create(KdtreeBackend.prototype) as KdtreeBackend, cpu, { kind: 'cuda', loaded: { ...cpu.loaded, probe: { ok: true, error: '', driverVersion: 0, runtimeVersion: 0, deviceCount, devices: [] } } });
    await expect(createEngine({ model: tiny, backend: cuda(1), tp: 2 })).rejects.toThrow('tp: 2 tensor-parallel ranks on this host need one CUDA device each (devices 0..1), but it has 1 (run at most --tp 1 per node, or more nodes)');
    // two nodes of 2: this host needs 2 devices, not 4
    await expect(createEngine({ model: tiny, backend: cuda(1), tp: 4, tpLocalRanks: 2, tpMaster: { host: '127.0.0.1', port: 0 } })).rejects.toThrow(/2 tensor-parallel ranks on this host need one CUDA device each \(devices 0\.\.1\), but it has 1/);
    await expect(createEngine({ model: tiny, backend: cuda(2), tp: 2, tpRanks: 'threads' })).rejects.toThrow(/tpRanks: ranks on the cuda backend are processes, one per device/);
    await expect(createEngine({ model: tiny, backend: cuda(2), tp: 2, device: 1 })).rejects.toThrow(/device: under tp > 1 each rank runs on the device of its local rank .* got device 1; pick the devices with CUDA_VISIBLE_DEVICES/);
  });
});

describe('a rank that joins rank 0 (JOIN)', () => {
  const setup: RankSetup = { model: '/on/node0/k2.kdtr', rows: 17, activations: 'f32', cacheTokens: 128, cacheDtype: 'f32', prefillChunk: 64, nodes: 17, maxDepth: 16, backend: 'cuda' };
  const id = Uint8Array.from({ length: 128 }, (_, i) => 255 - i);
  const reply: RankJoinReply = { world: 4, setup, slotFloats: 1, timeoutMs: 5000, fault: { rank: 3, at: 40, kind: 'exit' }, ncclId: ncclIdHex(id) };

  /** Rank 0's relay alone, listening on a free port. */
  async function rank0(join: RankJoinReply | undefined): Promise<{ port: number; relay: Worker }> {
    const relay = new Worker(builtModule('socket-relay.js'), { workerData: { memory: relayMemory(4, 1), rank: 0, timeoutMs: 5000, host: '127.0.0.1', port: 0, join } satisfies RelayData });
    const port = await new Promise<number>((resolve) => relay.on('message', (m: RelayMessage) => m.type === 'listening' && resolve(m.port)));
    return { port, relay };
  }

  it("gets the run's setup from rank 0: the NCCL id, its own fault only, and this host's model path", async () => {
    const { port, relay } = await rank0(reply);
    try {
      const two = await joinRun({ rank: 2, localRank: 0, world: 4, host: '127.0.0.1', port, timeoutMs: 5000, model: '/on/node1/k2.kdtr' });
      expect(two).toMatchObject({ rank: 2, localRank: 0, world: 4, host: '127.0.0.1', port, joined: true, slotFloats: 1, timeoutMs: 5000, setup: { ...setup, model: '/on/node1/k2.kdtr' } });
      expect(two.fault).toBeUndefined();
      expect([...ncclIdBytes(two.ncclId)]).toEqual([...id]);
      const three = await joinRun({ rank: 3, localRank: 1, world: 4, host: '127.0.0.1', port, timeoutMs: 5000 });
      expect(three.fault).toEqual({ rank: 3, at: 40, kind: 'exit' });
      expect(three.setup.model).toBe('/on/node0/k2.kdtr');
    } finally {
      await relay.terminate();
    }
  });

  it('is refused, naming both world sizes, when started for another world; and by a run that takes no joins', async () => {
    const { port, relay } = await rank0(reply);
    try {
      const error = await joinRun({ rank: 2, localRank: 0, world: 6, host: '127.0.0.1', port, timeoutMs: 5000 }).catch((e: unknown) => e);
      expect(error).toBeInstanceOf(RankFailure);
      expect((error as Error).message).toBe(`tensor-parallel rank 2 was refused by rank 0 at 127.0.0.1:${port}: rank 0 runs 4 ranks, but this rank was started for 6 (check --tp and --nnodes, or WORLD_SIZE, on every node)`);
    } finally {
      await relay.terminate();
    }
    const closed = await rank0(undefined);
    try {
      await expect(joinRun({ rank: 1, localRank: 1, world: 4, host: '127.0.0.1', port: closed.port, timeoutMs: 5000 })).rejects.toThrow(/this run takes no ranks from other nodes/);
    } finally {
      await closed.relay.terminate();
    }
  });

  it('waits for a rank 0 that is not up yet, then fails within the bound naming the address', async () => {
    const t0 = Date.now();
    const error = await joinRun({ rank: 1, localRank: 1, world: 2, host: '127.0.0.1', port: 1, timeoutMs: 500 }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(RankFailure);
    expect((error as Error).message).toMatch(/^tensor-parallel rank 1 could not join the run: rank 0 did not answer at 127\.0\.0\.1:1 within 500 ms \(last: .*ECONNREFUSED/);
    expect(Date.now() - t0).toBeLessThan(3000);
  });
});

describe('createEngine with ranks on another node (tpLocalRanks, tpMaster)', () => {
  it("node 1's ranks (startNodeRanks) join; the tokens are the golden ones, and no rank process is left", async () => {
    // alone, rank 0 names the rank that did not come
    const alone = await createEngine({ model: tiny, backend: 'cpu', cacheTokens: 128, tp: 2, tpLocalRanks: 1, tpMaster: { host: '127.0.0.1', port: 0 }, tpTimeoutMs: 100 }).catch((e: unknown) => e);
    expect((alone as Error).message).toMatch(/^tensor-parallel rank 1 did not join the run at 127\.0\.0\.1:\d+ within 100 ms$/);
    const port = 20000 + Math.floor(Math.random() * 20000);
    const [plan] = launchPlans({ tp: 1, nnodes: 2, nodeRank: 1, masterAddr: '127.0.0.1', masterPort: port }, {});
    const node1 = startNodeRanks([plan], { timeoutMs: 20_000, model: tiny });
    const engine = await createEngine({ model: tiny, backend: 'cpu', cacheTokens: 128, tp: 2, tpLocalRanks: 1, tpMaster: { host: '127.0.0.1', port } });
    try {
      expect(engine.rankPids).toEqual([]);
      expect((await engine.complete(golden.prompt, { maxNew: 16, eos: [] })).tokens).toEqual(golden.tokens);
    } finally {
      await engine.dispose();
    }
    await node1.done;
    expect(node1.pids.filter(alive)).toEqual([]);
  }, 120_000);

  it('refuses threads for ranks on other nodes, and a bad master', async () => {
    await expect(createEngine({ model: tiny, backend: 'cpu', tp: 2, tpLocalRanks: 1, tpRanks: 'threads' })).rejects.toThrow(/tpRanks: ranks that join from other nodes .* run as processes/);
    await expect(createEngine({ model: tiny, backend: 'cpu', tp: 2, tpLocalRanks: 3 })).rejects.toMatchObject({ field: 'tpLocalRanks' });
    await expect(createEngine({ model: tiny, backend: 'cpu', tp: 2, tpMaster: { host: '', port: 1 } })).rejects.toThrow(/tpMaster: expected \{ host, port \}/);
    expect(() => startNodeRanks(launchPlans({ tp: 2 }, {}), { timeoutMs: 100 })).toThrow(/rank 0 is the engine/);
  });
});

describe("rank 0 blocked in NCCL's init (TpGroup.blocking)", () => {
  /**
   * A rank 0 (its own process) whose thread blocks for good once rank 1 has joined, as
   * ncclCommInitRank does while a rank never reaches it; rank 1 is a bare socket of this test.
   */
  async function blockedRank0(timeoutMs: number, mode: 'init' | 'steps' | 'idle' = 'init') {
    const tp = pathToFileURL(join(import.meta.dirname, '../dist/tp.js')).href;
    const block = 'const cell = new Int32Array(new SharedArrayBuffer(4)); for (;;) Atomics.wait(cell, 0, 0);';
    const then = {
      init: `group.blocking(() => { ${block} });`,
      // a step blocked in a collective that no failure wakes
      steps: `group.guardSteps(); setTimeout(() => { ${block} }, 10);`,
      // an engine waiting for work: it takes the failure up, and ends on its own
      idle: `group.guardSteps(); setTimeout(() => { console.log(group.failure()?.message); process.exit(0); }, ${3 * timeoutMs});`,
    }[mode];
    const script = `const { TpGroup } = await import(${JSON.stringify(tp)});
      const group = await TpGroup.start(2, { model: 'none' }, { slotFloats: 1, timeoutMs: ${timeoutMs}, ranks: 'processes', localRanks: 1, master: { host: '127.0.0.1', port: Number(process.env.PORT) } });
      await group.joined();
      console.log('joined');
      ${then}`;
    const file = join(dir, `blocked-${mode}-${timeoutMs}.mjs`);
    writeFileSync(file, script);
    const port = 20000 + Math.floor(Math.random() * 20000);
    const child = spawn(process.execPath, [file], { env: { ...process.env, PORT: String(port) }, stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    child.stdout.on('data', (c: Buffer) => (out += c.toString()));
    child.stderr.on('data', (c: Buffer) => (err += c.toString()));
    const exit = new Promise<string | number>((resolve) => child.on('exit', (code, signal) => resolve(signal ?? code ?? -1)));
    // rank 1: connects (retrying until rank 0 listens) and says hello
    const socket = await new Promise<ReturnType<typeof connect>>((resolve) => {
      const attempt = () => {
        const s = connect(port, '127.0.0.1');
        s.once('connect', () => resolve(s));
        s.once('error', () => setTimeout(attempt, 100));
      };
      attempt();
    });
    socket.on('error', () => undefined);
    socket.write(frame(HELLO, 1));
    for (const t0 = Date.now(); !out.includes('joined') && Date.now() - t0 < 30_000; ) await new Promise((r) => setTimeout(r, 50));
    return { socket, exit, err: () => err, out: () => out };
  }

  it('a rank that dies meanwhile ends the process at once, naming it', async () => {
    const r = await blockedRank0(20_000);
    expect(r.out()).toContain('joined');
    const t0 = Date.now();
    r.socket.destroy();
    expect(await r.exit).toBe('SIGKILL');
    expect(Date.now() - t0).toBeLessThan(5000);
    expect(r.err()).toMatch(/^kdtree: error: tensor-parallel rank 1 exited \(its connection to rank 0 closed\); rank 0 was blocked in NCCL's init, which cannot be interrupted, so its process ends$/m);
  }, 60_000);

  it('a rank that never reaches it ends the process after the bound', async () => {
    const r = await blockedRank0(1000);
    const t0 = Date.now();
    expect(await r.exit).toBe('SIGKILL');
    expect(Date.now() - t0).toBeLessThan(5000);
    expect(r.err()).toMatch(/tensor-parallel rank 0 waited 1000 ms in NCCL's init \(ncclCommInitRank\) for ranks that did not reach it/);
    r.socket.destroy();
  }, 60_000);

  it('steps over NCCL: a failure that rank 0 does not take up (blocked in a collective) ends the process; one it takes up does not', async () => {
    const blocked = await blockedRank0(1000, 'steps');
    blocked.socket.destroy();
    expect(await blocked.exit).toBe('SIGKILL');
    expect(blocked.err()).toMatch(/tensor-parallel rank 1 exited \(its connection to rank 0 closed\); rank 0 was blocked in an NCCL collective, which cannot be interrupted, so its process ends/);
    const idle = await blockedRank0(1000, 'idle');
    idle.socket.destroy();
    expect(await idle.exit).toBe(0);
    expect(idle.out()).toContain('tensor-parallel rank 1 exited (its connection to rank 0 closed)');
  }, 60_000);
});
