/**
 * Shard directories (`kdtree shard`): every read a rank's layers make of its shard file gives the
 * bytes the same read of the unsharded bundle gives under load-time sharding (so the device holds
 * the same weights), and the tokens equal one rank's and the golden reference's, float and INT4,
 * tp 1, 2, 4 and 8. A world size other than the index's, an index whose blocks disagree with the
 * layers' split, and a weight that cannot be split are refused, naming the file or tensor; the
 * writer's lockstep fan-out keeps one chunk in memory and never hangs when a rank's writer fails.
 */
import { createHash } from 'node:crypto';
import { copyFileSync, cpSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { createBackend } from '@kdtree/cuda';
import { openBundle } from '@kdtree/format';
import { writeSyntheticModel, type GoldenRecord } from '@kdtree/reference';
import type { Collective } from './collective.js';
import { createEngine, DeviceModel, EngineError, ModelSource, ShardSource, writeShards, type GenerateOptions, type WeightReader } from './index.js';
import type { Block } from './shard.js';
import { coalesceReads, READ_GAP } from './model-source.js';
import { fanOut } from './shard-writer.js';
import { goldenTokens, tempDir } from './test-support/models.js';

const dir = tempDir('kdtree-shard-');
const models = [
  { name: 'tp8, float', quant: undefined },
  { name: 'tp8, INT4 routed experts', quant: 'kimi-k2' as const },
  { name: 'tp8, INT4 every MLP', quant: 'seed' as const },
];
const bundles = new Map<string, string>();
const goldens = new Map<string, GoldenRecord>();

/** The shard directory of bundle `name` over `world` ranks (written once). */
const shardDirs = new Map<string, Promise<string>>();
function shards(name: string, world: number): Promise<string> {
  const key = `${name} / ${world}`;
  let d = shardDirs.get(key);
  if (d === undefined) {
    d = (async () => {
      const out = join(dir, `${bundles.get(name)!.replace(/.*\//, '')}-tp${world}`);
      mkdirSync(out);
      const source = await ModelSource.open(bundles.get(name)!);
      try {
        await writeShards(source, world, out);
      } finally {
        await source.close();
      }
      return out;
    })();
    shardDirs.set(key, d);
  }
  return d;
}

beforeAll(async () => {
  for (const m of models) {
    const path = join(dir, `tp8-${m.quant ?? 'float'}.kdtr`);
    goldens.set(m.name, await writeSyntheticModel(path, { preset: 'tp8', seed: 3, quant: m.quant }, 'engine shard tests'));
    bundles.set(m.name, path);
  }
  bundles.set('tiny, INT4', join(dir, 'tiny-int4.kdtr'));
  await writeSyntheticModel(bundles.get('tiny, INT4')!, { preset: 'tiny', seed: 3, quant: 'kimi-k2' }, 'engine shard tests');
}, 60_000);

const sha = (a: ArrayBufferView) => createHash('sha256').update(new Uint8Array(a.buffer, a.byteOffset, a.byteLength)).digest('hex').slice(0, 16);

/**
 * A reader that logs every read (its arguments and a hash of what it returned) in the order the
 * reads were made (a linear's parts are read concurrently: each takes its place when asked for).
 */
function recording(inner: WeightReader, log: string[]): WeightReader {
  const args = (rows?: readonly number[], cols?: Block) => `${rows ? `${rows.length} rows from ${rows[0]}` : 'all rows'}, ${cols ? `K [${cols.start}, +${cols.count})` : 'all K'}`;
  const logged = async <T>(what: string, read: Promise<T>, describe: (r: T) => string): Promise<T> => {
    const at = log.push(`${what}: pending`) - 1;
    const r = await read;
    log[at] = `${what}: ${describe(r)}`;
    return r;
  };
  return {
    path: inner.path,
    config: inner.config,
    configJson: inner.configJson,
    int4: (name) => {
      const d = inner.int4(name);
      log.push(`int4 ${name}: ${d ? `[${d.shape.join(', ')}] / ${d.group_size} ${d.scale_dtype}` : 'float'}`);
      return d;
    },
    readF32: (name, shape) => logged(`f32 ${name}`, inner.readF32(name, shape), sha),
    readBf16: (name, shape, rows, cols) => logged(`bf16 ${name} (${args(rows, cols)})`, inner.readBf16(name, shape, rows, cols), (r) => `[${r.rows}, ${r.cols}] ${sha(r.bits)}`),
    readInt4: (name, shape, rows, cols) =>
      logged(`int4 ${name} (${args(rows, cols)})`, inner.readInt4(name, shape, rows, cols), (r) => `[${r.rows}, ${r.cols}] / ${r.group} ${r.scaleDtype} qw ${sha(r.qw)} sc ${sha(r.sc)}`),
    close: () => inner.close(),
  };
}

/**
 * Counts the bytes `source` reads from its files (whole tensors, ranged reads, streamed chunks),
 * on its store's own methods (a checked ranged read streams the tensor: its chunks count).
 */
function countReads(source: ModelSource): () => number {
  let bytes = 0;
  const store = source.store as unknown as {
    get(name: string): { size: number };
    readInto(name: string, target: Uint8Array, options?: { verify?: boolean }): Promise<Uint8Array>;
    readRange(name: string, start: number, length: number, target?: Uint8Array, options?: { verify?: boolean }): Promise<Uint8Array>;
    chunks(name: string, options?: object): AsyncGenerator<Uint8Array>;
  };
  const { readInto, readRange, chunks } = { readInto: store.readInto.bind(store), readRange: store.readRange.bind(store), chunks: store.chunks.bind(store) };
  store.readInto = (name, target, options) => {
    bytes += store.get(name).size;
    return readInto(name, target, options);
  };
  store.readRange = (name, start, length, target, options) => {
    if (options?.verify === false) bytes += length;
    return readRange(name, start, length, target, options);
  };
  store.chunks = async function* (name, options) {
    for await (const chunk of chunks(name, options)) {
      bytes += chunk.byteLength;
      yield chunk;
    }
  };
  return () => bytes;
}

/** Loads rank `rank` of `world` from `source` on a cpu backend (no forward runs: the collective is never called) and returns the reads it made. */
async function loadReads(source: WeightReader, rank: number, world: number): Promise<string[]> {
  const log: string[] = [];
  const b = createBackend({ backend: 'cpu' });
  try {
    const model = await DeviceModel.load(b, recording(source, log), { rows: 4, shard: { rank, world }, collective: { rank, world } as unknown as Collective });
    model.dispose();
  } finally {
    await source.close();
  }
  return log;
}

describe('a shard directory holds exactly what load-time sharding reads', () => {
  for (const m of models.filter((x) => x.quant !== 'kimi-k2')) {
    it(`${m.name}: every read of ranks 0 and N-1 of tp 2 and 8 gives the same bytes from the shard file as from the bundle`, async () => {
      for (const world of [2, 8]) {
        const out = await shards(m.name, world);
        for (const rank of [0, world - 1]) {
          const fromBundle = await loadReads(await ModelSource.open(bundles.get(m.name)!, { shard: { rank, world } }), rank, world);
          const fromShard = await loadReads(await ShardSource.open(out, { shard: { rank, world } }), rank, world);
          expect(fromShard.length).toBeGreaterThan(50);
          expect(fromShard).toEqual(fromBundle);
        }
      }
    }, 60_000);
  }

  it('load-time sharding reads from the bundle only a rank\'s blocks: 1/N of every split tensor (row-parallel K blocks too) and the replicated ones whole', async () => {
    for (const name of ['tp8, float', 'tp8, INT4 every MLP']) {
      for (const world of [2, 8]) {
        const index = JSON.parse(readFileSync(join(await shards(name, world), 'tp-index.json'), 'utf8')) as { tensors: Record<string, { split: string }> };
        const whole = await ModelSource.open(bundles.get(name)!);
        let expected = 0;
        let rowParallel = 0;
        try {
          for (const [tensor, t] of Object.entries(index.tensors)) {
            const d = whole.int4(tensor);
            const bytes = (d === undefined ? [tensor] : [d.qw, d.sc]).reduce((sum, p) => sum + whole.store.get(p).size, 0);
            expected += t.split === 'replicated' ? bytes : bytes / world;
            if (t.split === 'row') rowParallel += bytes;
          }
        } finally {
          await whole.close();
        }
        expect(rowParallel, `${name}: row-parallel bytes`).toBeGreaterThan(expected / 4);
        for (const rank of [0, world - 1]) {
          // readGap 0: exactly the selected bytes (the default also reads gaps of up to a page, which these small rows all are)
          const source = await ModelSource.open(bundles.get(name)!, { shard: { rank, world }, readGap: 0 });
          const read = countReads(source);
          const exact = await loadReads(source, rank, world);
          expect(read(), `${name}, rank ${rank} of ${world}: bytes read`).toBe(expected);
          // the same bytes as the default's coalesced reads
          expect(exact).toEqual(await loadReads(await ModelSource.open(bundles.get(name)!, { shard: { rank, world } }), rank, world));
        }
      }
    }
  }, 60_000);

  it('a rank\'s pieces are read as one range when back to back or less than a page apart, else each alone', () => {
    // o_proj of Kimi K2 at tp 8: bf16 rows of 16 KiB, 2 KiB of each a rank's: one read per row, of only those bytes
    const long = coalesceReads([0, 1, 2].map((r) => r * 16384 + 2048), 2048, READ_GAP);
    expect(long).toEqual([0, 1, 2].map((r) => ({ start: r * 16384 + 2048, end: r * 16384 + 4096, first: r, count: 1 })));
    // an expert's INT4 down_proj qw at tp 8: rows of 1 KiB, 128 bytes a rank's: the gaps are read too, in one range
    expect(coalesceReads([0, 1, 2].map((r) => r * 1024 + 128), 128, READ_GAP)).toEqual([{ start: 128, end: 2048 + 256, first: 0, count: 3 }]);
    // whole rows back to back are one range at any gap; rows out of order or past the gap start a new one
    expect(coalesceReads([0, 64, 128, 1 << 20, 0], 64, 0)).toEqual([
      { start: 0, end: 192, first: 0, count: 3 },
      { start: 1 << 20, end: (1 << 20) + 64, first: 3, count: 1 },
      { start: 0, end: 64, first: 4, count: 1 },
    ]);
    // a span stays within 8 MiB
    expect(coalesceReads([0, 4 << 20, 8 << 20], 4 << 20, 0).map((r) => r.count)).toEqual([2, 1]);
  });

  it('each rank file holds only its blocks: the ranks together are about one model, not N', async () => {
    const out = await shards('tp8, INT4 every MLP', 8);
    const files = readdirSync(out).sort();
    expect(files).toEqual(['rank-0.kdtr', 'rank-1.kdtr', 'rank-2.kdtr', 'rank-3.kdtr', 'rank-4.kdtr', 'rank-5.kdtr', 'rank-6.kdtr', 'rank-7.kdtr', 'tp-index.json']);
    const index = JSON.parse(readFileSync(join(out, 'tp-index.json'), 'utf8'));
    expect(index).toMatchObject({ schema: 'kdtree.tp-shards/1', world: 8, source: { name: 'tp8-seed.kdtr', format: 'kdtr' } });
    expect(index.tensors['model.layers.0.self_attn.q_b_proj.weight']).toEqual({ shape: [128, 32], split: 'column', blocks: Array.from({ length: 8 }, (_, r) => [r * 16, 16]) });
    expect(index.tensors['model.layers.1.mlp.experts.2.down_proj.weight']).toEqual({ shape: [64, 256], split: 'row', blocks: Array.from({ length: 8 }, (_, r) => [r * 32, 32]) });
    expect(index.tensors['model.layers.1.mlp.gate.weight']).toEqual({ shape: [4, 64], split: 'replicated' });
    expect(index.tensors['lm_head.weight'].split).toBe('column');
    // each rank's tensors hold the replicated weights whole and 1/8 of every split one, nothing else
    const source = await ModelSource.open(bundles.get('tp8, INT4 every MLP')!);
    try {
      let expected = 0;
      for (const [name, t] of Object.entries(index.tensors as Record<string, { split: string }>)) {
        const d = source.int4(name);
        const parts = d === undefined ? [name] : [d.qw, d.sc];
        const bytes = parts.reduce((sum, p) => sum + source.store.get(p).size, 0);
        expected += t.split === 'replicated' ? bytes : bytes / 8;
      }
      for (const file of files.filter((f) => f.endsWith('.kdtr'))) {
        const rank = await openBundle(join(out, file));
        expect(rank.tensors.reduce((sum, t) => sum + t.size, 0), file).toBe(expected);
        expect(rank.metadata['kdtree.tp_shard']).toEqual({ rank: Number(/\d+/.exec(file)![0]), world: 8, index: 'tp-index.json' });
        await rank.close();
      }
    } finally {
      await source.close();
    }
  }, 30_000);
});

const greedy: GenerateOptions = { maxNew: 16, eos: [] };
const ddtree: GenerateOptions = { maxNew: 16, eos: [], spec: 'ddtree', budget: 8, depth: 3 };

async function tokens(model: string, tp: number, options: GenerateOptions, golden: GoldenRecord): Promise<number[]> {
  const engine = await createEngine({ model, backend: 'cpu', cacheTokens: 128, maxBudget: 16, tp });
  try {
    expect(engine.tp).toBe(tp);
    return await goldenTokens(engine, golden, options);
  } finally {
    await engine.dispose();
  }
}

describe('a shard directory gives the tokens of one rank and of the golden reference', () => {
  for (const m of models.filter((x) => x.quant !== 'seed')) {
    it(`${m.name}: tp 1, 2, 4, 8 greedy; tp 2 and 8 DDTree`, async () => {
      const golden = goldens.get(m.name)!;
      expect(await tokens(bundles.get(m.name)!, 1, greedy, golden), 'tp 1 of the bundle').toEqual(golden.tokens);
      for (const tp of [1, 2, 4, 8]) {
        const out = await shards(m.name, tp);
        expect(await tokens(out, tp, greedy, golden), `tp ${tp} greedy`).toEqual(golden.tokens);
        if (tp === 2 || tp === 8) expect(await tokens(out, tp, ddtree, golden), `tp ${tp} ddtree`).toEqual(golden.tokens);
      }
    }, 120_000);
  }

  it('tp8, INT4 every MLP (dense, shared and routed down split in whole groups): tp 4 DDTree', async () => {
    const golden = goldens.get('tp8, INT4 every MLP')!;
    expect(await tokens(await shards('tp8, INT4 every MLP', 4), 4, ddtree, golden)).toEqual(golden.tokens);
  }, 60_000);
});

describe('what a shard directory refuses', () => {
  it('another world size than the index names: the index and both numbers', async () => {
    const out = await shards('tp8, float', 4);
    for (const tp of [1, 2]) {
      const err = await createEngine({ model: out, backend: 'cpu', cacheTokens: 128, tp }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(EngineError);
      expect(err).toMatchObject({ code: 'KDTREE_ENGINE_SHARD', field: 'tp' });
      expect((err as Error).message).toContain(`${join(out, 'tp-index.json')}: the shards were cut for tp 4, but the model is being loaded on tp ${tp}`);
    }
  }, 30_000);

  it('an index whose blocks are not the layers\' split: the tensor, what the rank holds and what its layer reads', async () => {
    const out = join(dir, 'swapped');
    cpSync(await shards('tp8, float', 2), out, { recursive: true });
    const path = join(out, 'tp-index.json');
    const index = JSON.parse(readFileSync(path, 'utf8'));
    index.tensors['lm_head.weight'].blocks.reverse();
    writeFileSync(path, JSON.stringify(index));
    const err = await loadReads(await ShardSource.open(out, { shard: { rank: 0, world: 2 } }), 0, 2).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'KDTREE_ENGINE_SHARD', field: 'lm_head.weight' });
    expect((err as Error).message).toContain(`${path}: rank 0 holds rows [128, 256) of lm_head.weight, but its layer reads row 0: the shards were cut by another split`);
  }, 30_000);

  it('a rank file the index was not written with: the file, and the header CRC-32 and length expected and found', async () => {
    const out = join(dir, 'replaced');
    cpSync(await shards('tp8, float', 2), out, { recursive: true });
    copyFileSync(join(out, 'rank-0.kdtr'), join(out, 'rank-1.kdtr'));
    const index = JSON.parse(readFileSync(join(out, 'tp-index.json'), 'utf8'));
    const err = await ShardSource.open(out, { shard: { rank: 1, world: 2 } }).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'KDTREE_ENGINE_MODEL', field: 'rank-1.kdtr' });
    expect((err as Error).message).toContain(`${out}: rank-1.kdtr: is not the file ${join(out, 'tp-index.json')} was written with (expected header CRC-32 ${index.ranks[1].header_crc32}, ${index.ranks[1].file_length} bytes; found header CRC-32 ${index.ranks[0].header_crc32}`);
  }, 30_000);

  it('a weight that cannot be split: named before any file is written', async () => {
    const out = join(dir, 'unsplittable');
    mkdirSync(out);
    const source = await ModelSource.open(bundles.get('tiny, INT4')!);
    try {
      const err = await writeShards(source, 2, out).catch((e: unknown) => e);
      expect(err).toMatchObject({ code: 'KDTREE_ENGINE_SHARD', field: 'model.layers.1.mlp.experts.0.down_proj.weight' });
      expect((err as Error).message).toMatch(/experts\.0\.down_proj\.weight \[64, 32\]: its intermediate size \(K\) \(32\) over 2 ranks is 16 per rank, not a multiple of its INT4 group \(32\)/);
    } finally {
      await source.close();
    }
    expect(readdirSync(out)).toEqual([]);
  });
});

describe('the writer\'s fan-out', () => {
  async function* counted(rounds: number, made: { n: number }): AsyncGenerator<Uint8Array[]> {
    for (let k = 0; k < rounds; k++) {
      made.n++;
      yield [new Uint8Array([k]), new Uint8Array(0), new Uint8Array([k, k])];
    }
  }

  it('hands each consumer its pieces in order, making a round only when every consumer took the last', async () => {
    const made = { n: 0 };
    const streams = fanOut(counted(20, made), 3);
    const seen: number[][] = [[], [], []];
    const ahead: number[] = [];
    await Promise.all(
      streams.map(async (s, i) => {
        for await (const piece of s) {
          seen[i].push(...piece);
          ahead.push(made.n - seen[0].length);
          // the slow consumer: the others must wait for it
          if (i === 0) await new Promise((r) => setTimeout(r, 5));
        }
      }),
    );
    const k = Array.from({ length: 20 }, (_, i) => i);
    expect(seen).toEqual([k, [], k.flatMap((i) => [i, i])]);
    // made but not yet seen by the slow consumer: the round it is being handed and at most the next
    expect(Math.max(...ahead)).toBeLessThanOrEqual(2);
  });

  it('a consumer that stops fails the others instead of leaving them waiting', async () => {
    const streams = fanOut(counted(100, { n: 0 }), 2);
    const results = await Promise.allSettled([
      (async () => {
        for await (const piece of streams[0]) if (piece[0] === 3) throw new Error('disk full');
      })(),
      (async () => {
        for await (const _ of streams[1]) await new Promise((r) => setTimeout(r, 1));
      })(),
    ]);
    expect(results.map((r) => r.status)).toEqual(['rejected', 'rejected']);
    expect((results[1] as PromiseRejectedResult).reason.message).toMatch(/rank 0's writer stopped before the end of the tensor/);
  });
});
