/**
 * The two ways the repository offers to run its CLI, run as a user would: `pnpm kdtree <args>`
 * (the root script: tools/kdtree.mjs, which resolves paths against the directory the user ran
 * it from, INIT_CWD) and the `kdtree` command that tools/link-cli.mjs puts on PATH.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';

const root = join(import.meta.dirname, '..', '..', '..');
const scratch = mkdtempSync(join(tmpdir(), 'kdtree-launchers-'));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));

const genModel = ['gen-model', '--preset', 'tiny', '--seed', '3', '-o', 'rel.kdtr', '--json'];

describe('the repository launchers', () => {
  it('pnpm kdtree (tools/kdtree.mjs, run from the root) writes a relative path where the user stands', () => {
    const cwd = mkdtempSync(join(scratch, 'wrapper-'));
    const r = spawnSync(process.execPath, [join(root, 'tools', 'kdtree.mjs'), ...genModel], { cwd: root, env: { ...process.env, INIT_CWD: cwd }, encoding: 'utf8' });
    expect(r.status, r.stderr).toBe(0);
    expect(existsSync(join(cwd, 'rel.kdtr'))).toBe(true);
    expect(existsSync(join(root, 'rel.kdtr'))).toBe(false);
  });

  it('link-cli writes an executable kdtree shim that runs this checkout from any directory, and removes only its own', () => {
    const bin = mkdtempSync(join(scratch, 'bin-'));
    const link = spawnSync(process.execPath, [join(root, 'tools', 'link-cli.mjs'), '--dir', bin], { encoding: 'utf8' });
    expect(link.status, link.stderr).toBe(0);
    const shim = join(bin, 'kdtree');
    expect(statSync(shim).mode & 0o111).not.toBe(0);
    expect(readFileSync(shim, 'utf8')).toContain(join(root, 'packages', 'cli', 'dist', 'bin.js'));
    const cwd = mkdtempSync(join(scratch, 'shim-'));
    const env: NodeJS.ProcessEnv = { ...process.env, PATH: `${bin}:${process.env.PATH}` };
    delete env.INIT_CWD;
    const r = spawnSync('kdtree', genModel, { cwd, env, encoding: 'utf8' });
    expect(r.status, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout).output).toBe('rel.kdtr');
    expect(existsSync(join(cwd, 'rel.kdtr'))).toBe(true);
    expect(spawnSync(process.execPath, [join(root, 'tools', 'link-cli.mjs'), '--remove', '--dir', bin]).status).toBe(0);
    expect(existsSync(shim)).toBe(false);
    // a kdtree it did not write is left alone
    writeFileSync(shim, '#!/bin/sh\necho another kdtree\n');
    const refused = spawnSync(process.execPath, [join(root, 'tools', 'link-cli.mjs'), '--dir', bin], { encoding: 'utf8' });
    expect(refused.status).toBe(1);
    expect(refused.stderr).toMatch(/exists and was not written by this script/);
    expect(readFileSync(shim, 'utf8')).toContain('another kdtree');
  });
});
