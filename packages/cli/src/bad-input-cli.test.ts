/**
 * Hostile and broken inputs: each is one line on stderr naming the file and what is wrong, exit 1
 * (bad data) or 2 (bad usage), never a stack trace (exit 70), and no output file written.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KdtrWriter, openBundle, writeSafetensors } from '@kdtree/format';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-bad-input-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const BIN = join(import.meta.dirname, '..', 'dist', 'bin.js');
const model = join(dir, 'tiny.kdtr');
const int4 = join(dir, 'tiny-int4.kdtr');

beforeAll(() => {
  expect(runCli(['gen-model', '--preset', 'tiny', '-o', model, '-q']).status).toBe(0);
  expect(runCli(['gen-model', '--preset', 'tiny', '-o', int4, '--quant', 'seed', '-q']).status).toBe(0);
});

/** A command that must fail cleanly: one line, the given exit code, matching `message`. */
function fails(args: string[], status: number, message: RegExp) {
  const r = runCli(args);
  expect(r.stderr, args.join(' ')).toMatch(message);
  expect(r.stderr, args.join(' ')).not.toMatch(/internal error|\n\s+at /);
  // One line; a usage error may add the usage line after it.
  const lines = r.stderr.trim().split('\n');
  expect(lines.length === 1 || (lines.length === 2 && lines[1].startsWith('usage: ')), args.join(' ')).toBe(true);
  expect(r.status, args.join(' ')).toBe(status);
  return r;
}

/** A copy of `src` with one byte of tensor `name` flipped (the CRC stays the original's). */
async function corrupt(src: string, name: string, out: string): Promise<void> {
  const b = await openBundle(src);
  const t = b.get(name);
  await b.close();
  const bytes = readFileSync(src);
  bytes[t.offset + Math.floor(t.size / 2)] ^= 0x40;
  writeFileSync(out, bytes);
}

describe('corrupt tensor data never passes through', () => {
  it('export, quantize, golden and import of a flipped byte exit 1 naming the tensor, and write nothing', async () => {
    const bad = join(dir, 'flipped.kdtr');
    const tensor = 'model.layers.1.mlp.experts.3.down_proj.weight';
    await corrupt(model, tensor, bad);
    const crc = new RegExp(`flipped\\.kdtr: tensor '${tensor.replace(/\./g, '\\.')}': field 'crc32': tensor data checksum mismatch`);
    const outputs = ['e.safetensors', 'q.kdtr', 'l.npy', 'i.kdtr'].map((n) => join(dir, n));
    fails(['export', bad, '-o', outputs[0], '-q'], 1, crc);
    fails(['quantize', bad, '-o', outputs[1], '--preset', 'seed', '-q'], 1, crc);
    fails(['golden', bad, '--prompt', '1,2,3', '--max-new', '2', '--logits', outputs[2]], 1, crc);
    fails(['import', bad, '-o', outputs[3], '-q'], 1, crc);
    for (const o of outputs) expect(existsSync(o), o).toBe(false);
    expect(readdirSync(dir).filter((n) => n.includes('.tmp-'))).toEqual([]);
  });

  it('an INT4 bundle with a flipped code is caught when the codes are read', async () => {
    const bad = join(dir, 'flipped-int4.kdtr');
    await corrupt(int4, 'model.layers.1.mlp.experts.0.up_proj.weight.qw', bad);
    fails(['golden', bad, '--prompt', '1,2', '--max-new', '1'], 1, /up_proj\.weight\.qw': field 'crc32': tensor data checksum mismatch/);
    fails(['export', bad, '-o', join(dir, 'ct/'), '--format', 'compressed-tensors', '-q'], 1, /checksum mismatch/);
  });
});

describe('importer edge cases', () => {
  async function shards(into: string) {
    mkdirSync(into, { recursive: true });
    await writeSafetensors(join(into, 'model-00001-of-00002.safetensors'), [{ name: 'a', dtype: 'F32', shape: [2], data: new Uint8Array(8) }]);
    await writeSafetensors(join(into, 'model-00002-of-00002.safetensors'), [{ name: 'b', dtype: 'F32', shape: [2], data: new Uint8Array(8) }]);
  }

  it('an index with an empty weight_map beside valid shards is an error, not a 0-tensor bundle', async () => {
    const hf = join(dir, 'empty-map');
    await shards(hf);
    writeFileSync(join(hf, 'model.safetensors.index.json'), '{"metadata": {}, "weight_map": {}}');
    fails(['import', hf, '-o', join(dir, 'empty.kdtr')], 1, /model\.safetensors\.index\.json: field 'weight_map': weight_map names no tensor/);
    expect(existsSync(join(dir, 'empty.kdtr'))).toBe(false);
  });

  it('a config.json that is a directory is an error, not skipped', async () => {
    const hf = join(dir, 'config-dir');
    await shards(hf);
    writeFileSync(join(hf, 'model.safetensors.index.json'), JSON.stringify({ weight_map: { a: 'model-00001-of-00002.safetensors', b: 'model-00002-of-00002.safetensors' } }));
    mkdirSync(join(hf, 'config.json'));
    fails(['import', hf, '-o', join(dir, 'cd.kdtr')], 1, /config\.json: model config is a directory, not a regular file/);
    fails(['import', hf, '-o', join(dir, 'cd.kdtr'), '--config', join(hf, 'config.json')], 1, /config\.json: is a directory, not a regular file/);
  });

  it('invalid UTF-8 in a config is refused (never stored as U+FFFD)', async () => {
    const hf = join(dir, 'latin1');
    mkdirSync(hf);
    await writeSafetensors(join(hf, 'model.safetensors'), [{ name: 'a', dtype: 'F32', shape: [2], data: new Uint8Array(8) }]);
    writeFileSync(join(hf, 'config.json'), Buffer.concat([Buffer.from('{"model_type": "caf'), Buffer.from([0xe9]), Buffer.from('"}')]));
    fails(['import', hf, '-o', join(dir, 'l1.kdtr')], 1, /config\.json: model config is not valid UTF-8, found invalid byte sequence at byte 19/);
    expect(existsSync(join(dir, 'l1.kdtr'))).toBe(false);
  });

  it('an INT4 bundle exported to one safetensors file imports back with its config and descriptors; golden agrees', () => {
    const st = join(dir, 'int4-one.safetensors');
    expect(runCli(['export', int4, '-o', st, '-q']).status).toBe(0);
    expect(existsSync(join(dir, 'int4-one.config.json'))).toBe(true);
    const back = join(dir, 'int4-back.kdtr');
    const imp = runCli(['import', st, '-o', back, '--json']);
    expect(imp.status, imp.stderr).toBe(0);
    expect(JSON.parse(imp.stdout)).toMatchObject({ config: join(dir, 'int4-one.config.json'), int4_weights: expect.any(Number) });
    expect(JSON.parse(imp.stdout).int4_weights).toBeGreaterThan(0);
    const golden = (m: string) => JSON.parse(runCli(['golden', m, '--prompt', '1,7,42', '--max-new', '6', '--json']).stdout).tokens;
    const expected = golden(int4);
    expect(expected).toHaveLength(6);
    expect(golden(back)).toEqual(expected);
    expect(golden(st)).toEqual(expected); // the reference reads the exported file in place too
    // And back out again: the same file, byte for byte.
    const again = join(dir, 'int4-again.safetensors');
    expect(runCli(['export', back, '-o', again, '-q']).status).toBe(0);
    expect(readFileSync(again).equals(readFileSync(st))).toBe(true);
  });
});

describe('clean failures', () => {
  it('deeply nested JSON in a config or a header: a clear error, nothing written', async () => {
    const hf = join(dir, 'deep');
    mkdirSync(hf);
    await writeSafetensors(join(hf, 'model.safetensors'), [{ name: 'a', dtype: 'F32', shape: [2], data: new Uint8Array(8) }]);
    writeFileSync(join(hf, 'config.json'), `{"a": ${'['.repeat(200_000)}${']'.repeat(200_000)}}`);
    fails(['import', hf, '-o', join(dir, 'deep.kdtr')], 1, /config\.json: model config is not valid JSON: nested deeper than 64 levels/);
    // A bundle whose metadata nests deeper than the limit (written around the writer's JSON).
    const deep = join(dir, 'deep-meta.kdtr');
    const w = await KdtrWriter.create(deep, { metadata: { config: 0 } });
    await w.close();
    const bytes = readFileSync(deep);
    const patched = Buffer.from(bytes.toString('latin1').replace('"config":0', `"config":${'['.repeat(70)}${']'.repeat(70)}`), 'latin1');
    const { crc32 } = await import('node:zlib');
    patched.writeBigUInt64LE(BigInt(patched.length - 4096), 24);
    patched.writeBigUInt64LE(BigInt(patched.length), 32);
    patched.writeUInt32LE(crc32(patched.subarray(4096)), 40);
    patched.writeUInt32LE(crc32(patched.subarray(0, 60)), 60);
    writeFileSync(deep, patched);
    fails(['export', deep, '-o', join(dir, 'deep-out/'), '-q'], 1, /deep-meta\.kdtr: header is not valid JSON: nested deeper than 64 levels/);
    expect(existsSync(join(dir, 'deep-out'))).toBe(false);
  });

  it('a shard path that is a directory', async () => {
    const hf = join(dir, 'shard-dir');
    mkdirSync(join(hf, 'model-00001-of-00001.safetensors'), { recursive: true });
    writeFileSync(join(hf, 'model.safetensors.index.json'), JSON.stringify({ weight_map: { a: 'model-00001-of-00001.safetensors' } }));
    fails(['inspect', hf], 1, /model-00001-of-00001\.safetensors: is a directory, not a regular file/);
  });

  it('numbers out of range are refused before anything is allocated', () => {
    fails(['golden', model, '--prompt', '1,2', '--max-new', '1e9'], 2, /--max-new: expected an integer, got '1e9'/);
    fails(['golden', model, '--prompt', '1,2', '--max-new', '1000000000'], 2, /--max-new: must be in \[0, 1048576\], got '1000000000'/);
    fails(['golden', model, '--prompt', '1,2', '--max-new', '100000'], 2, /--max-new: the prompt \(2 tokens\) \+ 100000 new = 100002 positions, more than the model's max_position_embeddings \(512\)/);
    fails(['golden', model, '--prompt', '1,2', '--max-new', '-1'], 2, /--max-new: must be in \[0, 1048576\], got '-1'/);
    fails(['golden', model, '--prompt', '1,2', '--max-new', '2', '--draft', model, '--budget', '1000000000'], 2, /--budget: must be in \[0, 1024\]/);
    fails(['golden', model, '--prompt', '1,2', '--max-new', '2', '--draft', model, '--depth', '1e9'], 2, /--depth: expected an integer, got '1e9'/);
    fails(['golden', model, '--prompt', '1,2', '--max-new', '2', '--draft', model, '--depth', '1000'], 2, /--depth: must be in \[1, 64\]/);
    fails(['golden', model, '--prompt', '1,,2', '--max-new', '2'], 2, /--prompt: .*an empty item at position 2 in '1,,2'/);
    fails(['import', model, '-o', join(dir, 'z.kdtr.json'), '--shard-size', '0'], 2, /--shard-size: must be at least 4096 bytes, got '0'/);
  });

  it('a file that is neither KDTR nor safetensors, and files the kernel will not read', () => {
    const zeros = join(dir, '.zeros.kdtr.tmp-1-00000000');
    writeFileSync(zeros, new Uint8Array(16384));
    fails(['verify', zeros], 1, /neither a KDTR bundle nor a safetensors file/);
    fails(['verify', '/proc/self/mem'], 1, /\/proc\/self\/mem: /);
    fails(['inspect', '/dev/zero'], 1, /\/dev\/zero: is a character device, not a regular file/);
  });

  it('inspect | head exits quietly when the reader goes away', async () => {
    const many = join(dir, 'many.kdtr');
    const w = await KdtrWriter.create(many);
    for (let i = 0; i < 3000; i++) await w.add({ name: `tensor.with.a.long.name.${i}`, dtype: 'U8', shape: [0] }, new Uint8Array(0));
    await w.close();
    const r = spawnSync('bash', ['-c', `"${process.execPath}" "${BIN}" inspect "${many}" | head -3; echo "status \${PIPESTATUS[0]}" >&2`], { encoding: 'utf8' });
    expect(r.stdout.split('\n')).toHaveLength(4);
    expect(r.stderr).toBe('status 0\n');
    const js = spawnSync('bash', ['-c', `"${process.execPath}" "${BIN}" inspect "${many}" --json | head -c 100 >/dev/null; echo "status \${PIPESTATUS[0]}" >&2`], { encoding: 'utf8' });
    expect(js.stderr).toBe('status 0\n');
  });

  it('mistyped commands and flags get a suggestion', () => {
    fails(['improt', 'x'], 2, /unknown command 'improt' \(did you mean import\?\)/);
    fails(['inspect', model, '--jsn'], 2, /inspect: unknown option '--jsn' \(did you mean --json\?\)/);
    fails(['golden', model, '--promt', '1', '--max-new', '1'], 2, /unknown option '--promt' \(did you mean --prompt\?\)/);
    fails(['quantize', model, '-o', join(dir, 'q2.kdtr'), '--preset', 'kimi'], 2, /--preset: expected one of kimi-k2, seed, got 'kimi' \(did you mean kimi-k2\?\)/);
  });
});
