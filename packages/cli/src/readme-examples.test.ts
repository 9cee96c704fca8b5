/**
 * Every code example in packages/*\/README.md runs, as a user would paste it, on the Node that runs
 * the tests (CI: the oldest supported, 20). TypeScript examples have their types stripped and
 * nothing else (target ESNext: syntax the runtime lacks, such as `await using` on Node 20, fails
 * here as it would for the user). Each runs in its own process in an empty directory.
 *
 * Every fenced block is either JavaScript/TypeScript (run) or marked `no-run` in its info string
 * (```sh no-run), so no example is skipped silently. It lives in @kdtree/cli because that package
 * depends on every other one, so each example's imports resolve as they do for a user.
 */
import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import ts from 'typescript';
import { afterAll, describe, expect, it } from 'vitest';

const PACKAGES = join(import.meta.dirname, '..', '..');
// Inside this package's node_modules, so `import '@kdtree/format'` resolves from the example.
const SCRIPTS = join(import.meta.dirname, '..', 'node_modules', '.readme-examples');
const work = mkdtempSync(join(tmpdir(), 'kdtree-readme-'));
afterAll(() => {
  rmSync(work, { recursive: true, force: true });
  rmSync(SCRIPTS, { recursive: true, force: true });
});

const RUN = new Set(['ts', 'typescript', 'js', 'javascript', 'mjs']);

interface Block {
  readme: string;
  line: number;
  lang: string;
  info: string;
  code: string;
}

export function codeBlocks(readme: string, text: string): Block[] {
  const blocks: Block[] = [];
  const lines = text.split('\n');
  for (let i = 0; i < lines.length; i++) {
    const open = /^(\s*)(`{3,}|~{3,})(.*)$/.exec(lines[i]);
    if (!open) continue;
    const fence = open[2];
    const info = open[3].trim();
    const body: string[] = [];
    let j = i + 1;
    while (j < lines.length && !lines[j].trimStart().startsWith(fence)) body.push(lines[j++]);
    blocks.push({ readme, line: i + 1, lang: info.split(/\s+/)[0] ?? '', info, code: body.join('\n') });
    i = j;
  }
  return blocks;
}

const readmes = readdirSync(PACKAGES)
  .map((p) => join(PACKAGES, p, 'README.md'))
  .filter((f) => {
    try {
      return readFileSync(f).length > 0;
    } catch {
      return false;
    }
  });
const blocks = readmes.flatMap((f) => codeBlocks(f.slice(PACKAGES.length + 1), readFileSync(f, 'utf8')));

describe('README examples', () => {
  it('finds the READMEs and their examples', () => {
    expect(readmes.length).toBeGreaterThanOrEqual(5);
    expect(blocks.filter((b) => RUN.has(b.lang)).length).toBeGreaterThanOrEqual(4);
  });

  it('every block is runnable code or marked no-run', () => {
    const unmarked = blocks.filter((b) => !RUN.has(b.lang) && !/\bno-run\b/.test(b.info)).map((b) => `${b.readme}:${b.line} (\`\`\`${b.info})`);
    expect(unmarked).toEqual([]);
    const skippedCode = blocks.filter((b) => RUN.has(b.lang) && /\bno-run\b/.test(b.info)).map((b) => `${b.readme}:${b.line}`);
    expect(skippedCode, 'JavaScript/TypeScript examples always run').toEqual([]);
  });

  for (const b of blocks.filter((x) => RUN.has(x.lang))) {
    it(`${b.readme}:${b.line} runs on Node ${process.versions.node}`, () => {
      const js = ts.transpileModule(b.code, {
        compilerOptions: { target: ts.ScriptTarget.ESNext, module: ts.ModuleKind.ESNext, verbatimModuleSyntax: false },
        reportDiagnostics: false,
      }).outputText;
      mkdirSync(SCRIPTS, { recursive: true });
      const script = join(SCRIPTS, `${b.readme.replace(/[/\\]/g, '-')}-${b.line}.mjs`);
      writeFileSync(script, js);
      const cwd = mkdtempSync(join(work, 'ex-'));
      const r = spawnSync(process.execPath, [script], { cwd, encoding: 'utf8', timeout: 120_000, env: { ...process.env, KDTREE_BACKEND: process.env.KDTREE_BACKEND ?? 'auto' } });
      expect(r.status, `${b.readme}:${b.line}\n${r.stderr}`).toBe(0);
    });
  }
});
