/**
 * The engine's step builders (Runner): each step captured as a graph replays to the bits of the
 * same ops called directly — the KV cache of every layer, the emitted token, the committed length,
 * and a tree step's accepted path — step after step, from the same state. A captured step that
 * read an input before the kernel writing it had finished (or a scalar fixed at capture that
 * should be read on the device) shows here as a difference.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createBackend, type DeviceTensor, type KdtreeBackend } from '@kdtree/cuda';
import { DeviceModel, ModelSource, Runner, type TreeBuffers } from './index.js';
import { view } from './linear.js';
import { syntheticPair, tempDir, TEST_BACKEND } from './test-support/models.js';

const PROMPT = [1, 7, 42, 3, 99, 5, 64, 11];

describe(`the engine's captured steps equal the same ops called directly (${TEST_BACKEND})`, () => {
  let b: KdtreeBackend;
  let model: DeviceModel;
  let r: Runner;
  let tree: TreeBuffers;
  let draft: DeviceTensor;
  const depth = 4;
  beforeAll(async () => {
    b = createBackend({ backend: TEST_BACKEND });
    const source = await ModelSource.open((await syntheticPair(tempDir(), 'tiny', 31)).target);
    model = await DeviceModel.load(b, source, { rows: 64 });
    await source.close();
    r = new Runner(b, model, 256, 'bf16', 64);
    tree = r.treeBuffers(33);
    // drafts that lead with the model's own continuation now and then: paths of several nodes
    let x = 99;
    const V = model.config.vocabSize;
    draft = r.own(b.fromArray('f32', [depth, V], Float32Array.from({ length: depth * V }, () => ((x = (Math.imul(x, 1103515245) + 12345) >>> 0) / 2 ** 32) * 6)));
  });
  afterAll(() => {
    r?.dispose();
    model?.dispose();
  });

  /** Every tensor a step writes that the next step reads, as host copies. */
  const state = () => [...r.cache.all(), r.token, r.cache.length[0], tree.path, tree.pathLen].map((t) => Buffer.from((b.toArray(t) as ArrayBufferView & { buffer: ArrayBuffer }).buffer.slice(0)));
  const restore = (s: Buffer[]) => [...r.cache.all(), r.token, r.cache.length[0], tree.path, tree.pathLen].forEach((t, i) => b.native.upload(t.buffer, new Uint8Array(s[i]), t.offset ?? 0));

  function compare(label: string, queue: (stream: number) => void, steps: number): void {
    r.prefill(PROMPT, 0);
    const start = state();
    const direct: Buffer[][] = [];
    for (let i = 0; i < steps; i++) {
      queue(0);
      b.synchronize();
      direct.push(state());
    }
    // the steps did something: the committed length moved on
    const L = (bytes: Buffer) => bytes.readInt32LE(0);
    expect(L(direct[steps - 1][r.cache.all().length + 1]), `${label}: the committed length`).toBeGreaterThan(L(start[r.cache.all().length + 1]));
    restore(start);
    const graph = r.graph(label, queue);
    for (let i = 0; i < steps; i++) {
      r.launch(graph);
      b.synchronize();
      const now = state();
      now.forEach((bytes, j) => expect(bytes.equals(direct[i][j]), `${label}, step ${i + 1}, tensor ${j}`).toBe(true));
    }
  }

  it('decode: 6 steps', () => {
    compare('decode', (s) => r.queueAppend(1, r.token, view(tree.logits, [1, model.config.vocabSize]), s), 6);
  });

  for (const budget of [4, 16, 32]) {
    it(`DDTree step of budget ${budget}, depth ${depth}: build, verify, accept, commit, 4 steps`, () => {
      compare(`tree ${budget}`, (s) => r.queueTreeStep(tree, draft, budget, s), 4);
    });
  }

  it('chain step of 4 nodes: 4 steps', () => {
    compare('chain 4', (s) => r.queueChainStep(tree, draft, 4, s), 4);
  });
});
