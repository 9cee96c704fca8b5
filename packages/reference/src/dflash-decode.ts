/**
 * DFlash + DDTree decoding on the reference: the target taps its hidden states during prefill and
 * verify, the DFlash drafter turns the committed ones into per-depth logits in one forward, and
 * DDTree builds, verifies and accepts the tree from them. Greedy acceptance: the tokens equal
 * greedyDecode's, whatever the drafter predicts.
 *
 *   prefill: target(prompt) with taps -> bonus b = argmax, context = taps of the prompt
 *   step:    logits = drafter(context since last round, [b, mask...])   positions start..start+B-1
 *            tree = buildDraftTree(b, logits[:depth]); verify with taps; accept path; commit
 *            context = taps of the path's nodes (b and the accepted drafts), b = the new bonus
 */
import { checkDflashPairing } from './dflash-config.js';
import type { DflashModel } from './dflash.js';
import { acceptTree, buildDraftTree, commitPath, verifyTree } from './ddtree.js';
import { ReferenceUsageError } from './errors.js';
import type { ForwardOptions, ReferenceModel } from './model.js';
import { argmax, rmsNorm } from './tensor-ops.js';

/**
 * Taps of one target forward over `rows` tokens: [rows, layers.length * hidden], the hidden state
 * after each listed layer, as transformers' output_hidden_states[id + 1] holds it — for the last
 * layer that entry is the final-normed state (transformers replaces it with the model's output).
 */
export function targetTaps(model: ReferenceModel, layerIds: readonly number[], rows: number): { onLayer: NonNullable<ForwardOptions['onLayer']>; hidden: Float32Array } {
  const H = model.config.hiddenSize;
  const last = model.config.numLayers - 1;
  const width = layerIds.length * H;
  const bad = layerIds.find((id) => !Number.isInteger(id) || id < 0 || id > last);
  if (bad !== undefined) throw new ReferenceUsageError(`target layer ${bad} is outside the target's ${model.config.numLayers} layers`);
  const hidden = new Float32Array(rows * width);
  const onLayer = (layer: number, x: Float32Array) => {
    layerIds.forEach((id, j) => {
      if (id !== layer) return;
      const state = layer === last ? rmsNorm(x, rows, H, model.weights.norm, model.config.rmsNormEps) : x;
      for (let t = 0; t < rows; t++) hidden.set(state.subarray(t * H, (t + 1) * H), t * width + j * H);
    });
  };
  return { onLayer, hidden };
}

export interface DflashDecodeOptions {
  maxNew: number;
  /** Draft nodes per tree (DDTree's B). */
  budget: number;
  /** Tree depth, 1..block_size - 1 (default block_size - 1: every drafted depth). */
  depth?: number;
  eos?: readonly number[];
}

export interface DflashDecodeResult {
  tokens: number[];
  /** Tokens emitted per target verify (accepted draft tokens + 1 bonus). */
  acceptedPerStep: number[];
  /** The drafter's argmax at each depth, per step (what a trace's draftTop1 must equal). */
  draftTop1PerStep: number[][];
  stoppedBy: 'eos' | 'max';
}

export function dflashDecode(target: ReferenceModel, drafter: DflashModel, prompt: readonly number[], options: DflashDecodeOptions): DflashDecodeResult {
  const dc = drafter.config;
  checkDflashPairing(dc, target.config);
  if (prompt.length === 0) throw new ReferenceUsageError('the prompt needs at least one token');
  if (!Number.isInteger(options.maxNew) || options.maxNew < 0) throw new ReferenceUsageError(`maxNew must be a non-negative integer, got ${options.maxNew}`);
  const depth = options.depth ?? dc.blockSize - 1;
  if (!Number.isInteger(depth) || depth < 1 || depth > dc.blockSize - 1) throw new ReferenceUsageError(`depth must be an integer in [1, ${dc.blockSize - 1}] (block_size ${dc.blockSize} drafts ${dc.blockSize - 1} depths), got ${depth}`);
  const eos = new Set(options.eos ?? target.config.eosTokenIds);
  const V = target.config.vocabSize;
  const ids = dc.targetLayerIds;
  const result: DflashDecodeResult = { tokens: [], acceptedPerStep: [], draftTop1PerStep: [], stoppedBy: 'max' };
  if (options.maxNew === 0) return result;
  const cache = target.newCache(prompt.length + options.maxNew + options.budget + 2);
  const draftCache = drafter.newCache();
  const prefill = targetTaps(target, ids, prompt.length);
  let root = argmax(target.forward(prompt, cache, { logitRows: [prompt.length - 1], onLayer: prefill.onLayer }));
  let context = prefill.hidden;
  let rows = prompt.length;
  result.tokens.push(root);
  if (eos.has(root)) return { ...result, stoppedBy: 'eos' };
  while (result.tokens.length < options.maxNew) {
    const start = cache.length;
    const { logits } = drafter.draft(draftCache, context, rows, root);
    const draft = logits.subarray(0, depth * V);
    result.draftTop1PerStep.push(Array.from({ length: depth }, (_, d) => argmax(draft, d * V, V)));
    const tree = buildDraftTree(root, draft, depth, V, options.budget);
    const taps = targetTaps(target, ids, tree.size);
    const verify = verifyTree(target, cache, tree, taps.onLayer);
    const post = Array.from({ length: tree.size }, (_, i) => argmax(verify, i * V, V));
    const { path, emitted, bonus } = acceptTree(tree, post);
    commitPath(cache, start, path);
    // the accepted nodes' hidden states are the next round's context, at positions start..
    const width = drafter.contextWidth;
    context = new Float32Array(path.length * width);
    path.forEach((node, k) => context.set(taps.hidden.subarray(node * width, (node + 1) * width), k * width));
    rows = path.length;
    result.acceptedPerStep.push(emitted.length);
    for (const t of emitted) {
      result.tokens.push(t);
      if (eos.has(t)) return { ...result, stoppedBy: 'eos' };
      if (result.tokens.length >= options.maxNew) return result;
    }
    root = bonus;
  }
  return result;
}
