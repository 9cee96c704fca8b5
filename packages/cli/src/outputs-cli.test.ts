/**
 * What the commands write: never over an input, never over a device or FIFO, names that say what
 * the file holds, the user's path in every error, and no temp files left by a killed run.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, linkSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { writeSafetensors } from '@kdtree/format';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-outputs-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const model = join(dir, 'tiny.kdtr');
const draft = join(dir, 'draft.kdtr');
const st = join(dir, 'w.safetensors');
const kdtr = join(dir, 'w.kdtr');

beforeAll(async () => {
  expect(runCli(['gen-model', '--preset', 'tiny', '-o', model, '--draft', draft, '-q']).status).toBe(0);
  await writeSafetensors(st, [{ name: 'a.weight', dtype: 'F32', shape: [4, 32], data: new Uint8Array(512).fill(7) }], { metadata: { format: 'pt' } });
  expect(runCli(['import', st, '-o', kdtr, '-q']).status).toBe(0);
});

/** Runs a command that must be refused with exit 2, leaving `protect` byte-identical. */
function refused(args: string[], protect: string[], message: RegExp): void {
  const before = protect.map((f) => readFileSync(f));
  const r = runCli(args);
  expect(r.stderr, args.join(' ')).toMatch(message);
  expect(r.status, args.join(' ')).toBe(2);
  expect(r.stderr.trim().split('\n')).toHaveLength(1);
  protect.forEach((f, i) => expect(readFileSync(f).equals(before[i]), f).toBe(true));
}

describe('an output is never one of the inputs', () => {
  it('in every command, by device and inode, not by the string', () => {
    const same = /is the input .*; writing it would destroy the input/;
    refused(['quantize', model, '-o', model, '--preset', 'seed'], [model], same);
    refused(['quantize', model, '-o', join(dir, '.', 'tiny.kdtr'), '--preset', 'seed'], [model], same);
    // The same file under a name that passes the name check: only its inode says it is the model.
    const alias = join(dir, 'model-alias.npy');
    linkSync(model, alias);
    refused(['golden', alias, '--prompt', '1,2', '--max-new', '2', '--logits', alias], [model], /--logits .*model-alias\.npy is the input/);
    refused(['golden', model, '--prompt', '1,2', '--max-new', '2', '--logits', model], [model], /--logits .*tiny\.kdtr is named as a KDTR bundle/);
    const draftAlias = join(dir, 'draft-alias.npy');
    linkSync(draft, draftAlias);
    refused(['golden', model, '--prompt', '1,2', '--max-new', '2', '--draft', draft, '--logits', draftAlias], [draft], /--logits .*draft-alias\.npy is the input .*draft\.kdtr/);
    refused(['export', st, '-o', st], [st], same);
    refused(['import', st, '-o', st], [st], /is named as a safetensors file/);
    const stAlias = join(dir, 'w-alias.kdtr');
    linkSync(st, stAlias);
    refused(['import', st, '-o', stAlias], [st], same);
    refused(['import', kdtr, '-o', kdtr], [kdtr], same);
    refused(['gen-model', '--preset', 'tiny', '-o', join(dir, 'x.kdtr'), '--draft', join(dir, 'x.kdtr')], [], /--draft .*x\.kdtr and -o .*x\.kdtr are the same file/);
    const config = join(dir, 'c.json');
    writeFileSync(config, '{"hidden_size": 4}');
    refused(['import', st, '-o', config, '--config', config, '--shard-size', '1MB'], [config], same);
  });

  it('a hard link or a symlink to an input is the input', () => {
    const hard = join(dir, 'hard.kdtr');
    linkSync(model, hard);
    const soft = join(dir, 'soft.kdtr');
    symlinkSync(model, soft);
    refused(['quantize', model, '-o', hard, '--preset', 'seed'], [model], /is the input/);
    refused(['quantize', soft, '-o', model, '--preset', 'seed'], [model], /is the input/);
  });

  it('a multi-file output whose shards would land on an input shard is refused', () => {
    const index = join(dir, 'm.kdtr.json');
    expect(runCli(['import', st, '-o', index, '--shard-size', '4KiB', '-q']).status).toBe(0);
    const shard = join(dir, 'm-00001.kdtr');
    expect(existsSync(shard)).toBe(true);
    refused(['quantize', shard, '-o', index, '--preset', 'seed', '--shard-size', '1MB'], [shard], /would write its shards over the input/);
  });
});

describe('non-regular files at the output path', () => {
  it('a FIFO or device node is never replaced by a regular file', () => {
    const fifo = join(dir, 'out.safetensors');
    expect(spawnSync('mkfifo', [fifo]).status).toBe(0);
    const r = runCli(['export', kdtr, '-o', fifo, '-q']);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/out\.safetensors: is a FIFO; an output is only ever written as a regular file/);
    expect(lstatSync(fifo).isFIFO()).toBe(true);
    const dev = runCli(['golden', model, '--prompt', '1', '--max-new', '1', '--logits', '/dev/null']);
    expect(dev.stderr).toMatch(/\/dev\/null: is a character device/);
    expect(lstatSync('/dev/null').isCharacterDevice()).toBe(true);
  });
});

describe('output names say what the file holds', () => {
  it('KDTR bytes are not written to a .safetensors name, nor safetensors to .kdtr', () => {
    const cases: [string[], RegExp][] = [
      [['import', st, '-o', join(dir, 'y.safetensors')], /-o .*y\.safetensors is named as a safetensors file, but import writes a KDTR bundle \(name it NAME\.kdtr\)/],
      [['quantize', model, '-o', join(dir, 'y.safetensors'), '--preset', 'seed'], /but quantize writes a KDTR bundle/],
      [['gen-model', '--preset', 'tiny', '-o', join(dir, 'y.safetensors')], /but gen-model writes a KDTR bundle/],
      [['gen-model', '--preset', 'tiny', '-o', join(dir, 'y.kdtr'), '--draft', join(dir, 'd.npy')], /--draft .*d\.npy is named as a NumPy \.npy array/],
      [['export', kdtr, '-o', join(dir, 'y.kdtr')], /export: -o .*y\.kdtr is neither a directory nor a \.safetensors name/],
      [['golden', model, '--prompt', '1', '--max-new', '1', '--logits', join(dir, 'l.kdtr')], /--logits .*l\.kdtr is named as a KDTR bundle, but golden writes a NumPy \.npy array/],
      [['import', st, '-o', join(dir, 'y.kdtr'), '--shard-size', '1MB'], /-o .*y\.kdtr is not a \.kdtr\.json name, but import writes the JSON index of a multi-file KDTR bundle/],
      [['import', st, '-o', join(dir, 'y.kdtr.json')], /is named as the JSON index of a multi-file KDTR bundle, but import writes a KDTR bundle/],
    ];
    for (const [args, message] of cases) {
      const r = runCli(args);
      expect(r.stderr, args.join(' ')).toMatch(message);
      expect(r.status).toBe(2);
    }
    expect(readdirSync(dir).filter((n) => n.startsWith('y.') || n.startsWith('l.') || n.startsWith('d.'))).toEqual([]);
  });

  it('export -o DIR: a trailing slash or an existing directory is a directory; anything else must be NAME.safetensors', () => {
    const r = runCli(['export', kdtr, '-o', join(dir, 'outdir'), '-q']);
    expect(r.status).toBe(2);
    expect(r.stderr).toMatch(/outdir is neither a directory nor a \.safetensors name; write .*outdir\/ for a model directory .* or .*outdir\.safetensors for one file/);
    expect(existsSync(join(dir, 'outdir'))).toBe(false);
    expect(runCli(['export', kdtr, '-o', join(dir, 'outdir/'), '-q']).status).toBe(0);
    expect(existsSync(join(dir, 'outdir', 'model.safetensors'))).toBe(true);
    mkdirSync(join(dir, 'existing'));
    expect(runCli(['export', kdtr, '-o', join(dir, 'existing'), '-q']).status).toBe(0);
    expect(existsSync(join(dir, 'existing', 'model.safetensors'))).toBe(true);
  });
});

describe('failures name the user\'s path, and leave nothing behind', () => {
  it('an output it cannot create names the output, not a temp file', () => {
    const out = join(dir, 'no-such-dir', 'q.kdtr');
    const r = runCli(['quantize', model, '-o', out, '--preset', 'seed']);
    expect(r.status).toBe(1);
    expect(r.stderr).toBe(`kdtree: error: ${out}: cannot create the output (ENOENT: no such directory in ${join(dir, 'no-such-dir')})\n`);
  });

  it('a later run of the same output removes the temp files of a killed run', () => {
    const out = join(dir, 'big.kdtr');
    // An import killed (SIGKILL, no cleanup) after its first chunk is in the temp file.
    const main = new URL('../dist/main.js', import.meta.url).href;
    const script = `import(${JSON.stringify(main)}).then(({ main }) => main(['import', ${JSON.stringify(st)}, '-o', ${JSON.stringify(out)}], { out() {}, err() {}, progress: () => ({ update: () => process.kill(process.pid, 'SIGKILL'), finish() {} }) }))`;
    expect(spawnSync(process.execPath, ['--input-type=module', '-e', script]).signal).toBe('SIGKILL');
    const temps = () => readdirSync(dir).filter((n) => n.startsWith('.big.kdtr.tmp-'));
    expect(temps()).toHaveLength(1);
    expect(existsSync(out)).toBe(false);
    expect(runCli(['import', st, '-o', out, '-q']).status).toBe(0);
    expect(temps()).toEqual([]);
  });
});

describe('an output directory that cannot be made', () => {
  it.runIf(process.platform === 'linux')('fails in one line, never spins (procfs refuses a child of a directory that exists)', () => {
    for (const args of [['export', model, '-o', '/proc/kdtree-no-such/out/'], ['shard', model, '--tp', '2', '-o', '/proc/kdtree-no-such/sh']]) {
      const r = runCli(args, { timeoutMs: 60_000 });
      expect(r.status, `${args.join(' ')}: ${r.stderr}`).toBe(1);
      expect(r.stderr).toMatch(/kdtree: error: \/proc\/kdtree-no-such: no such file or directory/);
    }
  });

  it('gen-model writes its DFlash drafter first: a path it cannot take fails before any bundle is written, and nothing is left', () => {
    const at = mkdtempSync(join(dir, 'dflash-'));
    writeFileSync(join(at, 'afile'), 'x');
    const target = join(at, 'walk.kdtr');
    const r = runCli(['gen-model', '--preset', 'tiny', '-o', target, '--draft', join(at, 'walk-draft.kdtr'), '--structure', 'walk', '--dflash', join(at, 'afile', 'sub'), '-q']);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/afile: not a directory/);
    expect(readdirSync(at)).toEqual(['afile']);
  });

  it("gen-model's outputs appear under their own names, nothing else left; a draft path that is a directory is refused before anything is written", () => {
    const at = mkdtempSync(join(dir, 'together-'));
    const r = runCli(['gen-model', '--preset', 'tiny', '-o', join(at, 't.kdtr'), '--draft', join(at, 'd.kdtr'), '--structure', 'walk', '--dflash', join(at, 'f'), '-q']);
    expect(r.status, r.stderr).toBe(0);
    expect(readdirSync(at).sort()).toEqual(['d.kdtr', 'f', 't.kdtr']);
    expect(readdirSync(join(at, 'f')).sort()).toEqual(['config.json', 'model.safetensors']);
    const other = mkdtempSync(join(dir, 'draft-dir-'));
    mkdirSync(join(other, 'd.kdtr'));
    const refusal = runCli(['gen-model', '--preset', 'tiny', '-o', join(other, 't.kdtr'), '--draft', join(other, 'd.kdtr'), '-q']);
    expect(refusal.status).toBe(2);
    expect(refusal.stderr).toMatch(/gen-model: --draft \S*d\.kdtr is a directory; give the path of a bundle file/);
    expect(readdirSync(other)).toEqual(['d.kdtr']);
  });

  it("gen-model clears a killed run's outputs pending under temporary names", () => {
    const at = mkdtempSync(join(dir, 'stale-'));
    const dead = Number(spawnSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))'], { encoding: 'utf8' }).stdout);
    writeFileSync(join(at, `.d.kdtr.tmp-${dead}-0123abcd`), 'x');
    mkdirSync(join(at, `.f.tmp-${dead}-4567abcd`));
    const r = runCli(['gen-model', '--preset', 'tiny', '-o', join(at, 't.kdtr'), '--draft', join(at, 'd.kdtr'), '--structure', 'walk', '--dflash', join(at, 'f'), '-q']);
    expect(r.status, r.stderr).toBe(0);
    expect(readdirSync(at).sort()).toEqual(['d.kdtr', 'f', 't.kdtr']);
  });
});
