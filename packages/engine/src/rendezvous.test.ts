import { describe, expect, it } from 'vitest';
import { fetchUniqueId, launchPlans, serveUniqueId } from './rendezvous.js';
import { RankFailure } from './shared-memory-transport.js';

const id = Uint8Array.from({ length: 128 }, (_, i) => (i * 37) & 255);

describe('rendezvous', () => {
  it('serves the id to every rank, whichever comes first, even before rank 0 listens', async () => {
    const world = 4;
    const port = 20000 + Math.floor(Math.random() * 20000);
    const early = fetchUniqueId({ rank: 3, host: '127.0.0.1', port, timeoutMs: 5000 });
    await new Promise((r) => setTimeout(r, 200));
    const served = serveUniqueId(id, { world, port, host: '127.0.0.1', timeoutMs: 5000 });
    await served.listening;
    const got = await Promise.all([early, fetchUniqueId({ rank: 1, host: '127.0.0.1', port, timeoutMs: 5000 }), fetchUniqueId({ rank: 2, host: '127.0.0.1', port, timeoutMs: 5000 })]);
    await served.done;
    for (const g of got) expect([...g]).toEqual([...id]);
  });

  it('names the ranks that never came, within the bound', async () => {
    const served = serveUniqueId(id, { world: 3, port: 0, host: '127.0.0.1', timeoutMs: 300 });
    const port = await served.listening;
    await fetchUniqueId({ rank: 1, host: '127.0.0.1', port, timeoutMs: 1000 });
    const t0 = Date.now();
    const error = await served.done.catch((e: unknown) => e);
    expect(error).toBeInstanceOf(RankFailure);
    expect((error as RankFailure).rank).toBe(2);
    expect((error as Error).message).toMatch(/rank 2 did not join the rendezvous .* within 300 ms/);
    expect(Date.now() - t0).toBeLessThan(1000);
  });

  it('a rank whose rank 0 never serves fails within the bound, naming rank 0', async () => {
    const error = await fetchUniqueId({ rank: 1, host: '127.0.0.1', port: 1, timeoutMs: 300 }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(RankFailure);
    expect((error as Error).message).toMatch(/rank 0 did not serve the NCCL id at 127.0.0.1:1 to rank 1 within 300 ms/);
  });
});

describe('launchPlans', () => {
  it('starts --tp ranks per node, numbered by node', () => {
    expect(launchPlans({ tp: 2 }, {})).toEqual([
      { rank: 0, world: 2, localRank: 0, masterAddr: '127.0.0.1', masterPort: 29500 },
      { rank: 1, world: 2, localRank: 1, masterAddr: '127.0.0.1', masterPort: 29500 },
    ]);
    const node1 = launchPlans({ tp: 2, nnodes: 2, nodeRank: 1, masterAddr: '10.0.0.1', masterPort: 6000 }, {});
    expect(node1.map((p) => [p.rank, p.localRank, p.world])).toEqual([
      [2, 0, 4],
      [3, 1, 4],
    ]);
    expect(node1[0].masterAddr).toBe('10.0.0.1');
  });

  it("honours torchrun's environment", () => {
    expect(launchPlans({}, { RANK: '5', WORLD_SIZE: '8', LOCAL_RANK: '1', MASTER_ADDR: 'h0', MASTER_PORT: '1234' })).toEqual([{ rank: 5, world: 8, localRank: 1, masterAddr: 'h0', masterPort: 1234 }]);
  });

  it('refuses inconsistent launches, naming the field', () => {
    expect(() => launchPlans({}, { RANK: '1' })).toThrow(/RANK: torchrun sets RANK and WORLD_SIZE together/);
    expect(() => launchPlans({}, { RANK: '8', WORLD_SIZE: '8' })).toThrow(/RANK 8 is not below WORLD_SIZE 8/);
    expect(() => launchPlans({ tp: 4, nnodes: 1 }, { RANK: '0', WORLD_SIZE: '8' })).toThrow(/--tp 4 x --nnodes 1 is 4 ranks, but WORLD_SIZE is 8/);
    expect(() => launchPlans({ tp: 2, nnodes: 2, nodeRank: 2, masterAddr: 'h' }, {})).toThrow(/node rank 2 is not below --nnodes 2/);
    expect(() => launchPlans({ tp: 2, nnodes: 2 }, {})).toThrow(/needs --master-addr/);
    expect(() => launchPlans({}, { MASTER_PORT: 'x' })).toThrow(/MASTER_PORT: expected an integer/);
    expect(() => launchPlans({ masterPort: 70000 }, {})).toThrow(/masterPort: expected a TCP port/);
  });
});
