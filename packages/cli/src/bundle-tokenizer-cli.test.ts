/**
 * Bundles carry their tokenizer: gen-model writes one where the preset's vocabulary has room,
 * import takes a HuggingFace directory's files, export to a directory writes them back.
 */
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { openBundle } from '@kdtree/format';
import { syntheticTokenizerFiles, Tokenizer, tokenizerMetadata } from '@kdtree/tokenizer';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-bundle-tokenizer-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

async function metadataOf(path: string): Promise<Record<string, unknown>> {
  const b = await openBundle(path);
  try {
    return b.metadata as Record<string, unknown>;
  } finally {
    await b.close();
  }
}

describe('bundles carry their tokenizer', () => {
  it('gen-model: tiny has none and says so; small gets the byte tokens only, target and draft', async () => {
    const tiny = join(dir, 'tiny.kdtr');
    const t = runCli(['gen-model', '--preset', 'tiny', '-o', tiny]);
    expect(t.status, t.stderr).toBe(0);
    expect(t.stdout).toMatch(/tokenizer: none \(a vocabulary of 128 has no room for 256 byte tokens and Kimi's 256 special slots/);
    expect((await metadataOf(tiny)).tokenizer).toBeUndefined();
    expect(runCli(['tokenize', tiny, 'x']).stderr).toMatch(/carries no tokenizer/);

    const small = join(dir, 'small.kdtr');
    const draft = join(dir, 'small-draft.kdtr');
    const s = runCli(['gen-model', '--preset', 'small', '-o', small, '--draft', draft, '--json']);
    expect(s.status, s.stderr).toBe(0);
    expect(JSON.parse(s.stdout).tokenizer).toEqual({ vocab_size: 512, ranks: 256, merges: 0, special_tokens: 256 });
    const expected = tokenizerMetadata(syntheticTokenizerFiles({ vocabSize: 512 }));
    expect((await metadataOf(small)).tokenizer).toEqual(expected);
    expect((await metadataOf(draft)).tokenizer).toEqual(expected);
    // no merges: every byte is its own token; special-token text is the special id
    const r = runCli(['tokenize', small, 'hé<|im_end|>']);
    expect(r.stdout.trim()).toBe([104, 0xc3, 0xa9, 256 + 2].join(','));
  });

  it('import takes a HuggingFace directory tokenizer files; export to a directory writes them back', async () => {
    const tiny = join(dir, 'for-hf.kdtr');
    expect(runCli(['gen-model', '--preset', 'tiny', '-o', tiny, '-q']).status).toBe(0);
    const hf = join(dir, 'hf');
    expect(runCli(['export', tiny, '-o', `${hf}/`, '-q']).status).toBe(0);
    const files = syntheticTokenizerFiles({ vocabSize: 1024 });
    for (const [name, content] of Object.entries(files)) writeFileSync(join(hf, name), content);

    const bundle = join(dir, 'imported.kdtr');
    const r = runCli(['import', hf, '-o', bundle, '--json']);
    expect(r.status, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout).tokenizer).toBe(hf);
    expect((await metadataOf(bundle)).tokenizer).toEqual(tokenizerMetadata(files));
    const text = 'Hello, 世界! <|im_end|>';
    expect(runCli(['tokenize', bundle, text]).stdout.trim()).toBe(new Tokenizer(files).encode(text).join(','));

    const back = join(dir, 'back');
    const e = runCli(['export', bundle, '-o', `${back}/`, '--json']);
    expect(e.status, e.stderr).toBe(0);
    expect(JSON.parse(e.stdout).tokenizer).toBe(true);
    for (const [name, content] of Object.entries(files)) expect(readFileSync(join(back, name), 'utf8'), name).toBe(content);
    // and a bundle imported from a bundle keeps it
    const again = join(dir, 'again.kdtr');
    expect(runCli(['import', bundle, '-o', again, '-q']).status).toBe(0);
    expect((await metadataOf(again)).tokenizer).toEqual(tokenizerMetadata(files));
  });

  it('import refuses a directory whose tokenizer files are broken, naming the file and line', () => {
    const tiny = join(dir, 'for-broken.kdtr');
    expect(runCli(['gen-model', '--preset', 'tiny', '-o', tiny, '-q']).status).toBe(0);
    const hf = join(dir, 'broken');
    mkdirSync(hf);
    expect(runCli(['export', tiny, '-o', `${hf}/`, '-q']).status).toBe(0);
    const files = syntheticTokenizerFiles({ vocabSize: 1024 });
    writeFileSync(join(hf, 'tokenizer_config.json'), files['tokenizer_config.json']);
    writeFileSync(join(hf, 'tiktoken.model'), 'not base64 at all\n');
    const r = runCli(['import', hf, '-o', join(dir, 'broken.kdtr')]);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/broken\/tiktoken\.model: line 1/);
    expect(r.stderr).not.toMatch(/internal error|    at /);
  });
});
