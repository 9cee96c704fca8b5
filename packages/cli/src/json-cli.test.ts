/**
 * Every --json output names its schema (`kdtree.<command>/<version>`, first key) and uses one
 * naming style (snake_case keys), and packages/cli/README.md documents each schema's fields.
 */
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { writeSafetensors } from '@kdtree/format';
import { COMMANDS } from './main.js';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-json-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const README = readFileSync(join(import.meta.dirname, '..', 'README.md'), 'utf8');
/** The synthetic tokenizer directory @kdtree/tokenizer commits for its tests. */
const TOKENIZER = join(import.meta.dirname, '..', '..', 'tokenizer', 'fixtures', 'synthetic-8192');

/** Keys of `value` at every depth, except inside user data (bundle metadata, model configs). */
function keys(value: unknown, path = ''): string[] {
  if (Array.isArray(value)) return value.flatMap((v, i) => keys(v, `${path}[${i}]`));
  if (typeof value !== 'object' || value === null) return [];
  return Object.entries(value).flatMap(([k, v]) => (['metadata', 'config'].includes(k) && path === '' ? [k] : [k, ...keys(v, `${path}.${k}`)]));
}

describe('--json outputs', () => {
  it('each carries its schema first and uses snake_case keys', async () => {
    const model = join(dir, 'm.kdtr');
    const st = join(dir, 'w.safetensors');
    await writeSafetensors(st, [{ name: 'model.layers.0.mlp.experts.0.up_proj.weight', dtype: 'F32', shape: [8, 32], data: new Uint8Array(1024) }]);
    const runs: Record<string, string[]> = {
      'gen-model': ['gen-model', '--preset', 'tiny', '-o', model, '--quant', 'seed', '--json'],
      import: ['import', st, '-o', join(dir, 'w.kdtr'), '--json'],
      export: ['export', model, '-o', join(dir, 'out/'), '--json'],
      inspect: ['inspect', model, '--json'],
      verify: ['verify', model, '--json'],
      quantize: ['quantize', join(dir, 'w.kdtr'), '-o', join(dir, 'q.kdtr'), '--preset', 'kimi-k2', '--json'],
      shard: ['shard', model, '--tp', '1', '-o', join(dir, 'shards'), '--json'],
      golden: ['golden', model, '--prompt', '1,2', '--max-new', '2', '--json'],
      run: ['run', model, '--prompt', '1,2', '--max-new', '3', '--backend', 'cpu', '--spec', 'ddtree', '--budget', '4', '--depth', '2', '--trace', '--json'],
      backend: ['backend', '--backend', 'cpu', '--json'],
      tokenize: ['tokenize', TOKENIZER, 'Hello, 世界', '--json'],
      detokenize: ['detokenize', TOKENIZER, '1,2,3', '--json'],
    };
    const withJson = COMMANDS.filter((c) => 'json' in c.spec.options).map((c) => c.spec.name);
    expect(Object.keys(runs).sort()).toEqual(withJson.sort());
    for (const [command, args] of Object.entries(runs)) {
      const r = runCli(args);
      expect(r.status, `${command}: ${r.stderr}`).toBe(0);
      const out = JSON.parse(r.stdout) as Record<string, unknown>;
      expect(Object.keys(out)[0], command).toBe('schema');
      expect(out.schema, command).toBe(`kdtree.${command}/1`);
      const bad = keys(out).filter((k) => !/^[a-z][a-z0-9]*(_[a-z0-9]+)*$/.test(k));
      expect(bad, command).toEqual([]);
      // The README documents the schema and every top-level field.
      const start = README.indexOf(`**\`kdtree.${command}/1\`**`);
      expect(start, `README documents kdtree.${command}/1`).toBeGreaterThan(0);
      const end = README.indexOf('**`kdtree.', start + 1);
      const section = README.slice(start, end < 0 ? undefined : end);
      for (const k of Object.keys(out).filter((k) => k !== 'schema')) expect(section, `${command}.${k}`).toContain(`\`${k}\``);
    }
  });
});
