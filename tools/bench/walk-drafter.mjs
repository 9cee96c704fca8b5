// What the walk target's built DFlash drafter puts on its alternatives, and what DDTree makes of
// them (docs/benchmarks/engine.md, "A DFlash drafter that predicts its target"), on the reference:
//   - per depth, along greedy's tokens: the drafter's top-1 probability against how often its
//     top-1 and its second token are right, and the logits of its three best tokens;
//   - tokens a step of the chain and of DDTree at budgets 3, 7, 16 and 32 with the drafter as
//     built, and with its logits rewritten as a calibrated two-candidate draft: at depth d the +1
//     path's token (coordinate of the bonus + d) at 1 - q and the next coordinate at q, where q is
//     the rate of +2 steps in greedy's own continuation. Every decode is checked against greedy.
//   node tools/bench/walk-drafter.mjs [--preset k2-mini] [--max-new 128]
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { dflashDecode, GOLDEN_PROMPT, greedyDecode, loadDflashModel, loadModel, parseModelConfig, presetConfigJson, targetTaps, walkStructure } from '@kdtree/reference';
import { run, table } from './bench-util.mjs';

const { values } = parseArgs({ options: { preset: { type: 'string', default: 'k2-mini' }, 'max-new': { type: 'string', default: '128' } } });
const preset = values.preset;
const maxNew = Number(values['max-new']);
const BLOCK = 8;
const DEPTH = BLOCK - 1;
if (!Number.isInteger(maxNew) || maxNew <= DEPTH) throw new Error(`--max-new must be an integer above ${DEPTH} (a drafted block needs ${DEPTH} tokens after it), got ${values['max-new']}`);

// the demo's and the walk-bench's models, made as a user makes them (seed 1: the walk of
// walkStructure(config, 1); the target is the draft model's weights plus 5% noise, the walk kept)
const cli = fileURLToPath(new URL('../../packages/cli/dist/bin.js', import.meta.url));
const dir = mkdtempSync(join(tmpdir(), 'kdtree-walk-drafter-'));
try {
  const config = parseModelConfig(presetConfigJson(preset), preset);
  const V = config.vocabSize;
  const walk = walkStructure(config, 1);
  const targetPath = join(dir, 'target.kdtr');
  const flashPath = join(dir, 'dflash');
  run(process.execPath, [cli, 'gen-model', '--preset', preset, '--structure', 'walk', '--quant', 'kimi-k2', '-o', targetPath, '--draft', join(dir, 'draft.kdtr'), '--dflash', flashPath, '--dflash-block', String(BLOCK), '--quiet']);
  const target = (await loadModel(targetPath)).model;
  const model = (await loadDflashModel(flashPath, target)).model;
  const prompt = GOLDEN_PROMPT;
  const greedy = greedyDecode(target, prompt, { maxNew, eos: [] }).tokens;
  const tokens = [...prompt, ...greedy];
  const step = (i) => (((walk.coordinate[tokens[i]] - walk.coordinate[tokens[i - 1]]) % V) + V) % V;
  const twoSteps = greedy.filter((_, j) => step(prompt.length + j) === 2).length;
  const q = twoSteps / greedy.length;
  if (q === 0 || q === 1) throw new Error(`greedy's walk took ${q === 0 ? 'no' : 'only'} +2 steps: no two-candidate draft to calibrate`);
  console.log(`${preset}, the golden prompt, ${maxNew} greedy tokens: ${twoSteps} steps of +2 on the walk (q = ${q.toFixed(3)})`);

  // 1. the drafter at every position of greedy's tokens with DEPTH tokens after it
  const taps = targetTaps(target, model.config.targetLayerIds, tokens.length);
  target.forward(tokens, target.newCache(tokens.length), { logitRows: [tokens.length - 1], onLayer: taps.onLayer });
  const width = model.contextWidth;
  const cache = model.newCache();
  const perDepth = Array.from({ length: DEPTH }, () => ({ n: 0, p1: 0, right1: 0, right2: 0, logits: [0, 0, 0] }));
  let from = 0;
  let rows = prompt.length;
  for (let pos = prompt.length; pos + DEPTH < tokens.length; pos++) {
    const { logits } = model.draft(cache, taps.hidden.subarray(from * width, (from + rows) * width), rows, tokens[pos]);
    from += rows;
    rows = 1;
    for (let d = 0; d < DEPTH; d++) {
      const row = logits.subarray(d * V, (d + 1) * V);
      const order = Array.from(row.keys()).sort((a, b) => row[b] - row[a]).slice(0, 3);
      let sum = 0;
      for (const x of row) sum += Math.exp(x - row[order[0]]);
      const s = perDepth[d];
      s.n++;
      s.p1 += 1 / sum;
      s.right1 += order[0] === tokens[pos + 1 + d] ? 1 : 0;
      s.right2 += order[1] === tokens[pos + 1 + d] ? 1 : 0;
      order.forEach((t, j) => (s.logits[j] += row[t]));
    }
  }
  const pct = (x) => `${(100 * x).toFixed(1)}%`;
  console.log(`the drafter at the ${perDepth[0].n} positions of greedy's tokens with ${DEPTH} tokens after them:`);
  console.log(table(
    ['depth', 'top-1 probability', 'top-1 right', 'second right', 'logits of the best three'],
    perDepth.map((s, d) => [String(d + 1), (s.p1 / s.n).toFixed(3), pct(s.right1 / s.n), pct(s.right2 / s.n), s.logits.map((x) => (x / s.n).toFixed(1)).join(' / ')]),
  ));

  // 2. chain and DDTree, the drafter as built and calibrated
  const tokenAt = new Int32Array(V);
  walk.coordinate.forEach((c, t) => (tokenAt[c] = t));
  const built = model.draft.bind(model);
  // a row's draft as [token, logit] pairs, best first (all other tokens at -1e4), or undefined
  // for the built drafter's own row; a chain keeps the first pair
  const pairs = (row, bonus, d, calibrated) => {
    if (calibrated) {
      const plusOne = tokenAt[(walk.coordinate[bonus] + d) % V], plusTwo = tokenAt[(walk.coordinate[bonus] + d + 1) % V];
      return q <= 0.5 ? [[plusOne, Math.log(1 - q)], [plusTwo, Math.log(q)]] : [[plusTwo, Math.log(q)], [plusOne, Math.log(1 - q)]];
    }
    return [[row.reduce((best, x, i) => (x > row[best] ? i : best), 0), 0]];
  };
  // tokens a step as the engine counts them: the tokens after prefill's one over the verifies
  const decode = (calibrated, chain, budget) => {
    model.draft = (c, context, n, bonus) => {
      const out = built(c, context, n, bonus);
      if (!calibrated && !chain) return out;
      for (let d = 1; d <= DEPTH; d++) {
        const row = out.logits.subarray((d - 1) * V, d * V);
        const kept = pairs(row, bonus, d, calibrated).slice(0, chain ? 1 : undefined);
        row.fill(-1e4);
        for (const [t, x] of kept) row[t] = x;
      }
      return out;
    };
    let r;
    try {
      r = dflashDecode(target, model, prompt, { maxNew, budget, depth: chain ? budget : undefined, eos: [] });
    } finally {
      model.draft = built;
    }
    if (r.tokens.join() !== greedy.join()) throw new Error(`${chain ? 'chain' : 'DDTree'} ${budget} (${calibrated ? 'calibrated' : 'built'}) differs from greedy`);
    return ((r.tokens.length - 1) / r.acceptedPerStep.length).toFixed(2);
  };
  console.log(table(
    ['budget', 'chain, built', 'DDTree, built', 'chain, calibrated', 'DDTree, calibrated'],
    [3, 7, 16, 32].map((budget) => {
      const chainCell = (calibrated) => (budget <= DEPTH ? decode(calibrated, true, budget) : '-');
      return [String(budget), chainCell(false), decode(false, false, budget), chainCell(true), decode(true, false, budget)];
    }),
  ));
} finally {
  rmSync(dir, { recursive: true, force: true });
}
