/**
 * The conformance set (conformance/, written by scripts/gen-conformance.mjs) run through our
 * reader and through tools/kdtr_reader.py, the independent reader written from the spec: both must
 * accept every valid case and reject every invalid one, and ours must report the listed error.
 */
import { spawnSync } from 'node:child_process';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { FormatError } from './errors.js';
import { openBundle } from './kdtr-reader.js';
import { tempDir } from './test-support/tmp.js';

const SET = fileURLToPath(new URL('../conformance', import.meta.url));
const GENERATOR = fileURLToPath(new URL('../scripts/gen-conformance.mjs', import.meta.url));
const PY_READER = fileURLToPath(new URL('../../../tools/kdtr_reader.py', import.meta.url));

interface Case {
  file: string;
  expect: 'valid' | 'invalid';
  section: string;
  description: string;
  error?: { code: string; field?: string };
}

const manifest = JSON.parse(readFileSync(join(SET, 'manifest.json'), 'utf8')) as { cases: Case[] };

function listFiles(dir: string): string[] {
  return readdirSync(dir, { recursive: true, encoding: 'utf8' })
    .filter((f) => statSync(join(dir, f)).isFile())
    .sort();
}

/** Opens the case and reads every tensor (each read checks its CRC): the error, or undefined. */
async function readCase(path: string): Promise<unknown> {
  try {
    const bundle = await openBundle(path);
    try {
      for (const t of bundle.tensors) await bundle.read(t.name);
    } finally {
      await bundle.close();
    }
    return undefined;
  } catch (error) {
    return error;
  }
}

describe('KDTR conformance set', () => {
  it('is exactly what the generator writes', () => {
    const fresh = tempDir('kdtree-conformance-');
    const r = spawnSync(process.execPath, [GENERATOR, fresh], { encoding: 'utf8' });
    expect(r.stderr).toBe('');
    const generated = listFiles(SET).filter((f) => f !== 'README.md');
    expect(listFiles(fresh)).toEqual(generated);
    for (const f of generated) expect(readFileSync(join(fresh, f)).equals(readFileSync(join(SET, f))), f).toBe(true);
  });

  it('lists every file of the directory, and both outcomes', () => {
    // A single-file case is listed by its path; an index case by its directory's model.kdtr.json.
    const listed = new Set(manifest.cases.map((c) => (c.file.endsWith('/model.kdtr.json') ? c.file.slice(0, -'/model.kdtr.json'.length) : c.file)));
    for (const f of listFiles(SET).filter((f) => f !== 'manifest.json' && f !== 'README.md')) {
      expect(listed.has(f) || listed.has(f.split('/').slice(0, 2).join('/')), f).toBe(true);
    }
    expect(manifest.cases.filter((c) => c.expect === 'valid').length).toBeGreaterThan(5);
    expect(manifest.cases.filter((c) => c.expect === 'invalid').length).toBeGreaterThan(40);
  });

  for (const c of manifest.cases) {
    it(`${c.expect}: ${c.file} (${c.description})`, async () => {
      const error = await readCase(join(SET, c.file));
      if (c.expect === 'valid') {
        expect(error).toBeUndefined();
        return;
      }
      expect(error).toBeInstanceOf(FormatError);
      const e = error as FormatError;
      expect({ code: e.code, field: e.field }).toEqual({ code: c.error!.code, field: c.error!.field });
    });
  }

  it('the independent Python reader agrees on every case', () => {
    const r = spawnSync('python3', [PY_READER, '--each', ...manifest.cases.map((c) => join(SET, c.file))], { encoding: 'utf8', maxBuffer: 16 << 20 });
    if (r.error) throw new Error(`python3 is needed for the cross-language spec test: ${r.error.message}`);
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    const results = r.stdout.trim().split('\n').map((l) => JSON.parse(l) as { file: string; ok: boolean; error: string | null });
    const disagreements = manifest.cases
      .map((c, i) => ({ c, got: results[i] }))
      .filter(({ c, got }) => got.ok !== (c.expect === 'valid'))
      .map(({ c, got }) => `${c.file}: expected ${c.expect}, python ${got.ok ? 'accepts' : `rejects (${got.error})`}`);
    expect(disagreements).toEqual([]);
  });
});
