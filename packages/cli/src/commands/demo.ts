import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ddtreeDecode, greedyDecode, loadModel, modelDrafter, type GoldenRecord } from '@kdtree/reference';
import type { CommandSpec, Parsed } from '../args.js';
import { CliError } from '../cli-error.js';
import type { CommandIO } from '../io.js';
import { runExport } from './export.js';
import { runGenModel } from './gen-model.js';
import { runImport } from './import.js';
import { runInspect } from './inspect.js';
import { runVerify } from './verify.js';

export const demoSpec: CommandSpec = {
  name: 'demo',
  summary: 'The main job end to end on a small Kimi K2-shaped model: generate it with INT4 routed experts and a draft model, verify and inspect the bundle, decode it as read back with the golden reference (its recorded golden tokens), decode again with DDTree speculation (must equal greedy), and round-trip the weights through the compressed-tensors format of the real Kimi K2 checkpoints.',
  usage: 'kdtree demo [--preset tiny|small|k2-mini] [--keep DIR]',
  help: ['--preset NAME         model size (default small)', '--keep DIR            work in DIR and keep the files (default: a temp dir, removed)'],
  options: { keep: { type: 'string' }, preset: { type: 'string' } },
  positionals: [0, 0],
};

export async function runDemo(p: Parsed, io: CommandIO): Promise<number> {
  const dir = (p.values.keep as string | undefined) ?? (await mkdtemp(join(tmpdir(), 'kdtree-demo-')));
  const preset = (p.values.preset as string | undefined) ?? 'small';
  const section = (title: string) => io.out(`\n== ${title}`);
  try {
    const bundle = join(dir, `${preset}-int4.kdtr`);
    const draftPath = join(dir, `${preset}-draft.kdtr`);
    section(`1. generate a ${preset} Kimi K2-shaped model: INT4 routed experts, a draft model, golden tokens`);
    await runGenModel({ values: { preset, seed: '1', output: bundle, quant: 'kimi-k2', draft: draftPath, quiet: true }, positionals: [] }, io);

    section('2. verify every checksum and inspect the bundle');
    await runVerify({ values: { quiet: true }, positionals: [bundle] }, io);
    await runInspect({ values: { filter: '^model\\.layers\\.1\\.(mlp\\.experts\\.0\\.|self_attn\\.q_a)|^golden' }, positionals: [bundle] }, io);

    // The golden tokens were decoded by the same reference from the weights before they were
    // written, so this checks the bundle (every weight the forward pass reads came back), not the
    // decoder; step 4 checks DDTree against greedy decoding.
    section('3. the bundle read back decodes to the golden tokens recorded when it was written (the KDTR round trip)');
    const { model, metadata } = await loadModel(bundle);
    const golden = metadata.golden as GoldenRecord;
    const greedy = greedyDecode(model, golden.prompt, { maxNew: golden.max_new, eos: [] });
    if (greedy.tokens.join() !== golden.tokens.join()) throw new CliError(`demo: the bundle read back decodes to [${greedy.tokens}], not the golden tokens recorded when it was written [${golden.tokens}]`);
    io.out(`prompt [${golden.prompt.join(', ')}] -> [${greedy.tokens.join(', ')}]  (the golden tokens recorded at generation)`);

    section('4. DDTree speculative decoding with the draft model: identical tokens, fewer target forwards');
    const { model: draft } = await loadModel(draftPath);
    const budget = 16;
    const depth = 4;
    const spec = ddtreeDecode(model, golden.prompt, { maxNew: golden.max_new, budget, depth, drafter: modelDrafter(draft), eos: [] });
    if (spec.tokens.join() !== greedy.tokens.join()) throw new CliError(`demo: DDTree tokens [${spec.tokens}] differ from greedy [${greedy.tokens}]`);
    const perStep = spec.tokens.length / Math.max(1, spec.acceptedPerStep.length + 1);
    io.out(`budget ${budget}, depth ${depth}: ${spec.acceptedPerStep.length + 1} target forwards (prefill + verifies) for ${spec.tokens.length} tokens, ${perStep.toFixed(2)} tokens per forward; accepted per step [${spec.acceptedPerStep.join(', ')}]`);

    section('5. round trip through compressed-tensors (the format of the real Kimi K2.x checkpoints)');
    const hfDir = join(dir, 'compressed-tensors');
    const back = join(dir, 'reimported.kdtr');
    await runExport({ values: { output: `${hfDir}/`, format: 'compressed-tensors', quiet: true }, positionals: [bundle] }, io);
    await runImport({ values: { output: back, quiet: true }, positionals: [hfDir] }, io);
    const { model: again } = await loadModel(back);
    const tokensAgain = greedyDecode(again, golden.prompt, { maxNew: golden.max_new, eos: [] }).tokens;
    if (tokensAgain.join() !== golden.tokens.join()) throw new CliError('demo: the re-imported model decodes differently');
    io.out('re-imported model decodes the same golden tokens');
    io.out(`\ndemo OK${p.values.keep ? ` (files in ${dir})` : ''}`);
    return 0;
  } finally {
    if (p.values.keep === undefined) await rm(dir, { recursive: true, force: true });
  }
}
