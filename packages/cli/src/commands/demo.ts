import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { openBundle, openSafetensors, writeSafetensors } from '@kdtree/format';
import type { CommandSpec, Parsed } from '../args.js';
import { CliError } from '../cli-error.js';
import type { CommandIO } from '../io.js';
import { runExport } from './export.js';
import { runImport } from './import.js';
import { runInspect } from './inspect.js';
import { runVerify } from './verify.js';

export const demoSpec: CommandSpec = {
  name: 'demo',
  summary: 'The main job end to end on a small generated checkpoint: write safetensors, import to KDTR, verify, inspect, export back and check the bytes.',
  usage: 'kdtree demo [--keep DIR]',
  help: ['--keep DIR            work in DIR and keep the files (default: a temp dir, removed)'],
  options: { keep: { type: 'string' } },
  positionals: [0, 0],
};

function pseudoRandom(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n);
  let x = seed;
  for (let i = 0; i < n; i++) {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    out[i] = x >>> 24;
  }
  return out;
}

export async function runDemo(p: Parsed, io: CommandIO): Promise<number> {
  const dir = (p.values.keep as string | undefined) ?? (await mkdtemp(join(tmpdir(), 'kdtree-demo-')));
  try {
    const source = join(dir, 'demo.safetensors');
    const tensors = [
      { name: 'model.embed_tokens.weight', dtype: 'BF16' as const, shape: [512, 64] },
      { name: 'model.layers.0.self_attn.q_proj.weight', dtype: 'BF16' as const, shape: [64, 64] },
      { name: 'model.layers.0.mlp.gate_proj.weight', dtype: 'F32' as const, shape: [128, 64] },
      { name: 'model.norm.weight', dtype: 'F32' as const, shape: [64] },
    ];
    const sizes = { BF16: 2, F32: 4 };
    const data = tensors.map((t, i) => pseudoRandom(t.shape.reduce((a, b) => a * b, 1) * sizes[t.dtype], i + 1));
    await writeSafetensors(source, tensors.map((t, i) => ({ ...t, data: data[i] })), { metadata: { format: 'pt' } });
    io.out(`== wrote ${source}`);
    const bundle = join(dir, 'demo.kdtr');
    const roundTrip = join(dir, 'roundtrip.safetensors');
    await runImport({ values: { output: bundle, quiet: true }, positionals: [source] }, io);
    await runVerify({ values: { quiet: true }, positionals: [bundle] }, io);
    await runInspect({ values: {}, positionals: [bundle] }, io);
    await runExport({ values: { output: roundTrip, quiet: true }, positionals: [bundle] }, io);
    const back = await openSafetensors(roundTrip);
    const kdtr = await openBundle(bundle);
    try {
      for (const [i, t] of tensors.entries()) {
        const bytes = await back.read(t.name);
        if (!Buffer.from(bytes).equals(Buffer.from(data[i]))) throw new CliError(`demo: tensor '${t.name}' changed in the round trip`);
      }
    } finally {
      await back.close();
      await kdtr.close();
    }
    io.out(`== round trip safetensors -> KDTR -> safetensors: all ${tensors.length} tensors byte-identical`);
    return 0;
  } finally {
    if (p.values.keep === undefined) await rm(dir, { recursive: true, force: true });
  }
}
