import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KdtrWriter } from '@kdtree/format';
import { syntheticTokenizerFiles, Tokenizer, tokenizerMetadata } from '@kdtree/tokenizer';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-tokenize-'));
const model = join(dir, 'model');
const bundle = join(dir, 'm.kdtr');
const bare = join(dir, 'bare.kdtr');
const files = syntheticTokenizerFiles({ vocabSize: 1024 });
const tokenizer = new Tokenizer(files);
const text = 'Hello, 世界! <|im_end|> 123';

beforeAll(async () => {
  mkdirSync(model);
  for (const [name, content] of Object.entries(files)) writeFileSync(join(model, name), content);
  const w = await KdtrWriter.create(bundle, { metadata: { tokenizer: tokenizerMetadata(files) } });
  await w.add({ name: 'w', dtype: 'F32', shape: [2] }, new Float32Array(2));
  await w.close();
  const b = await KdtrWriter.create(bare, { metadata: {} });
  await b.add({ name: 'w', dtype: 'F32', shape: [2] }, new Float32Array(2));
  await b.close();
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('kdtree tokenize / detokenize', () => {
  it('prints the ids comma-separated, special tokens parsed unless --no-special', () => {
    const r = runCli(['tokenize', model, text]);
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    expect(r.stdout).toBe(`${tokenizer.encode(text).join(',')}\n`);
    expect(r.stdout.split(',').map(Number)).toContain(tokenizer.specialId('<|im_end|>'));
    const plain = runCli(['tokenize', model, text, '--no-special']);
    expect(plain.stdout).toBe(`${tokenizer.encode(text, { allowSpecial: false }).join(',')}\n`);
    expect(plain.stdout.split(',').map(Number)).not.toContain(tokenizer.specialId('<|im_end|>'));
  });

  it('prints stable JSON and reads the text from a file or standard input', () => {
    const f = join(dir, 'in.txt');
    writeFileSync(f, `${text}\n`);
    const r = runCli(['tokenize', model, '--file', f, '--json']);
    expect(JSON.parse(r.stdout)).toEqual({ schema: 'kdtree.tokenize/1', ids: tokenizer.encode(`${text}\n`) });
    expect(Object.keys(JSON.parse(r.stdout))).toEqual(['schema', 'ids']);
    const bin = fileURLToPath(new URL('../dist/bin.js', import.meta.url));
    const stdin = spawnSync(process.execPath, [bin, 'tokenize', model, '--file', '-'], { input: text, encoding: 'utf8' });
    expect(stdin.stdout).toBe(`${tokenizer.encode(text).join(',')}\n`);
    const bad = join(dir, 'bad.txt');
    writeFileSync(bad, Uint8Array.of(0x61, 0xff));
    expect(runCli(['tokenize', model, '--file', bad]).stderr).toMatch(/bad\.txt: not valid UTF-8 text/);
  });

  it('decodes ids back to the text', () => {
    const ids = tokenizer.encode(text);
    expect(runCli(['detokenize', model, ids.join(',')]).stdout).toBe(`${text}\n`);
    expect(runCli(['detokenize', model, ids.join(' ')]).stdout).toBe(`${text}\n`);
    expect(JSON.parse(runCli(['detokenize', model, ids.join(', '), '--json']).stdout)).toEqual({ schema: 'kdtree.detokenize/1', text });
    expect(runCli(['detokenize', model, ids.join(','), '--skip-special']).stdout).toBe('Hello, 世界!  123\n');
  });

  it('reads the tokenizer a bundle carries', () => {
    expect(runCli(['tokenize', bundle, text]).stdout).toBe(`${tokenizer.encode(text).join(',')}\n`);
    expect(runCli(['detokenize', bundle, tokenizer.encode(text).join(',')]).stdout).toBe(`${text}\n`);
    const r = runCli(['tokenize', bare, 'x']);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/bare\.kdtr: the bundle carries no tokenizer \(metadata\.tokenizer\); give the model directory it came from as MODEL/);
  });

  it('reports bad input in one line naming it', () => {
    const cases: [string[], number, RegExp][] = [
      [['tokenize', model], 2, /tokenize: give the text or --file F, not neither/],
      [['tokenize', model, 'x', '--file', 'f'], 2, /not both/],
      [['tokenize', join(dir, 'absent'), 'x'], 1, /absent: no such file or directory \(expected a model directory or a KDTR bundle\)/],
      [['tokenize', dir, 'x'], 1, /kdtree-tokenize-\w+: tiktoken\.model is missing/],
      [['detokenize', model, '1,x,3'], 2, /IDS element 2 'x' is not a token id/],
      [['detokenize', model, '1,-2'], 2, /IDS element 2 '-2' is not a token id/],
      [['detokenize', model, '5,1024'], 1, /token id 1024 \(element 2\) is outside the vocabulary \[0, 1024\)/],
    ];
    for (const [args, status, message] of cases) {
      const r = runCli(args);
      expect(r.status, args.join(' ')).toBe(status);
      expect(r.stderr, args.join(' ')).toMatch(message);
      expect(r.stderr.startsWith('kdtree: error: '), args.join(' ')).toBe(true);
    }
  });
});
