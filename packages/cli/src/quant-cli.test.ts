import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { KdtrWriter, openBundle } from '@kdtree/format';
import { runCli } from './test-support/run-cli.js';

const TORCH = join(import.meta.dirname, '..', '..', 'quant', 'fixtures', 'torch');
const dir = mkdtempSync(join(tmpdir(), 'kdtree-quant-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('kdtree quantize / compressed-tensors import and export', () => {
  it('quantize --preset kimi-k2 then export --format compressed-tensors reproduces torch byte for byte', () => {
    const f = join(dir, 'f.kdtr');
    const q = join(dir, 'q.kdtr');
    expect(runCli(['import', join(TORCH, 'model-bf16'), '-o', f, '-q']).status).toBe(0);
    const r = runCli(['quantize', f, '-o', q, '--preset', 'kimi-k2', '--json']);
    expect(r.stderr).toBe('');
    const summary = JSON.parse(r.stdout);
    expect(summary).toMatchObject({ schema: 'kdtree.quantize/1', quantized: 12, scheme: 'minmax', group_size: 32, scale_dtype: 'BF16' });
    expect(summary.classes).toEqual([expect.objectContaining({ tensor_class: 'routed expert', tensors: 12 })]);
    expect(summary.bytes_after).toBeLessThan(summary.bytes_before);
    const out = join(dir, 'ct-out/');
    expect(runCli(['export', q, '-o', out, '--format', 'compressed-tensors', '-q']).status).toBe(0);
    expect(readFileSync(join(out, 'model.safetensors')).equals(readFileSync(join(TORCH, 'model-ct', 'model.safetensors')))).toBe(true);
    const config = JSON.parse(readFileSync(join(out, 'config.json'), 'utf8'));
    const torchConfig = JSON.parse(readFileSync(join(TORCH, 'model-ct', 'config.json'), 'utf8'));
    expect(config.quantization_config).toMatchObject({ quant_method: 'compressed-tensors', format: 'pack-quantized', ignore: torchConfig.quantization_config.ignore });
    expect(config.quantization_config.config_groups.group_0.weights).toMatchObject(torchConfig.quantization_config.config_groups.group_0.weights);
  });

  it('imports a compressed-tensors checkpoint keeping packed codes, and exports it back identical', async () => {
    const k = join(dir, 'ct.kdtr');
    const r = runCli(['import', join(TORCH, 'model-ct'), '-o', k, '--json']);
    expect(JSON.parse(r.stdout).int4_weights).toBe(12);
    const b = await openBundle(k);
    expect(b.has('model.layers.1.mlp.experts.0.down_proj.weight.qw')).toBe(true);
    expect(b.has('model.layers.1.mlp.experts.0.down_proj.weight_packed')).toBe(false);
    const d = (b.metadata.quantization as { tensors: Record<string, unknown> }).tensors['model.layers.1.mlp.experts.0.down_proj.weight'];
    expect(d).toMatchObject({ shape: [64, 32], group_size: 32, scale_dtype: 'BF16', scheme: 'compressed-tensors' });
    await b.close();
    const out = join(dir, 'ct-back.safetensors');
    expect(runCli(['export', k, '-o', out, '--format', 'compressed-tensors', '-q']).status).toBe(0);
    expect(readFileSync(out).equals(readFileSync(join(TORCH, 'model-ct', 'model.safetensors')))).toBe(true);
    expect(JSON.parse(readFileSync(join(dir, 'ct-back.config.json'), 'utf8')).quantization_config).toEqual(
      JSON.parse(readFileSync(join(TORCH, 'model-ct', 'config.json'), 'utf8')).quantization_config,
    );
  });

  it('rejects bad quantization input with one line naming the tensor and numbers', async () => {
    const bad = join(dir, 'bad.kdtr');
    const w = await KdtrWriter.create(bad);
    await w.add({ name: 'model.layers.1.mlp.experts.0.up_proj.weight', dtype: 'F32', shape: [4, 36] }, new Float32Array(144));
    await w.close();
    const r = runCli(['quantize', bad, '-o', join(dir, 'x.kdtr'), '--preset', 'kimi-k2']);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/tensor 'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight': K = 36 \(shape \[4, 36\]\) is not a multiple of 8/);
    expect(() => readFileSync(join(dir, 'x.kdtr'))).toThrow(); // nothing half-written

    const nan = join(dir, 'nan.kdtr');
    const w2 = await KdtrWriter.create(nan);
    const values = new Float32Array(64);
    values[5] = Number.NaN;
    await w2.add({ name: 'model.layers.1.mlp.experts.0.up_proj.weight', dtype: 'F32', shape: [2, 32] }, values);
    await w2.close();
    expect(runCli(['quantize', nan, '-o', join(dir, 'y.kdtr'), '--preset', 'kimi-k2']).stderr).toMatch(/weight \[0, 5\] is NaN/);

    const rules = join(dir, 'rules.json');
    writeFileSync(rules, JSON.stringify({ targets: ['re:.*experts.*'], ignore: ['re:.*vision_tower.*'] }));
    expect(runCli(['quantize', nan, '-o', join(dir, 'z.kdtr'), '--rules', rules]).stderr).toMatch(/ignore entry 're:\.\*vision_tower\.\*' matches no tensor/);
    expect(runCli(['quantize', nan, '-o', join(dir, 'z.kdtr'), '--preset', 'kimi-k2', '--group', '48']).status).toBe(2);

    const orphan = join(dir, 'orphan.kdtr');
    const w3 = await KdtrWriter.create(orphan);
    await w3.add({ name: 'x.weight.qw', dtype: 'I32', shape: [2, 4] }, new Int32Array(8));
    await w3.close();
    expect(runCli(['export', orphan, '-o', join(dir, 'o.safetensors'), '--format', 'compressed-tensors']).stderr).toMatch(/'x\.weight\.qw' has no scales 'x\.weight\.sc'/);
  });
});
