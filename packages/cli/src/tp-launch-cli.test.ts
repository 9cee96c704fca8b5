/**
 * `kdtree run` over several nodes, on one host: two `kdtree run` processes as node 0 and node 1
 * (2 ranks each, world 4, master 127.0.0.1 and a free port), and four torchrun-style processes
 * (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Node 0 / RANK 0 prints the tokens of
 * --tp 1 and of the golden reference, greedy and DDTree; a rank process killed mid-run, one that
 * exits, and a node that never connects end the run within the bound, non-zero, naming the rank,
 * with no process left behind.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { runCli } from './test-support/run-cli.js';

const BIN = fileURLToPath(new URL('../dist/bin.js', import.meta.url));
const dir = mkdtempSync(join(tmpdir(), 'kdtree-tp-launch-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
// k2-mini: 4 heads, INT4 routed experts of 4 groups, so 4 ranks
const model = join(dir, 'k2-mini.kdtr');
let golden: { prompt: number[]; tokens: number[] };

beforeAll(() => {
  const r = runCli(['gen-model', '--preset', 'k2-mini', '--seed', '7', '--quant', 'kimi-k2', '-o', model, '--json']);
  expect(r.status, r.stderr).toBe(0);
  golden = JSON.parse(r.stdout).golden;
}, 120_000);

interface Proc {
  child: ChildProcess;
  stdout: string;
  stderr: string;
  /** Settles with the exit status (a signal's name when killed). */
  exit: Promise<number | string>;
  /** Its rank processes, as seen while it ran. */
  ranks: Set<number>;
}

function start(args: string[], env: NodeJS.ProcessEnv = {}): Proc {
  const child = spawn(process.execPath, [BIN, ...args], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  const p: Proc = { child, stdout: '', stderr: '', ranks: new Set(), exit: Promise.resolve(0) };
  child.stdout!.on('data', (c: Buffer) => (p.stdout += c.toString()));
  child.stderr!.on('data', (c: Buffer) => (p.stderr += c.toString()));
  const watch = setInterval(() => childrenOf(child.pid!).forEach((pid) => p.ranks.add(pid)), 100);
  p.exit = new Promise((resolve) =>
    child.on('exit', (code, signal) => {
      clearInterval(watch);
      resolve(code ?? signal ?? -1);
    }),
  );
  return p;
}

/** The process ids of `pid`'s children (Linux). */
function childrenOf(pid: number): number[] {
  try {
    return readFileSync(`/proc/${pid}/task/${pid}/children`, 'utf8').trim().split(/\s+/).filter(Boolean).map(Number);
  } catch {
    return [];
  }
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** Waits up to `ms` for `check` to hold. */
async function until(check: () => boolean, ms: number): Promise<boolean> {
  for (const t0 = Date.now(); Date.now() - t0 < ms; ) {
    if (check()) return true;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  return check();
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      server.close(() => resolve(typeof address === 'object' && address !== null ? address.port : 0));
    });
  });
}

const ddtree = ['--spec', 'ddtree', '--budget', '8', '--depth', '3'];

function runArgs(extra: string[], maxNew = 16): string[] {
  return ['run', model, '--prompt', golden.prompt.join(','), '--max-new', String(maxNew), '--eos', '', '--backend', 'cpu', ...extra];
}

/** Node 0 and node 1 of a run of 2 nodes x 2 ranks; node 1 first, as either may come first. */
async function twoNodes(extra: string[], options: { maxNew?: number; node1?: boolean; env0?: NodeJS.ProcessEnv } = {}) {
  const port = await freePort();
  const launch = ['--tp', '2', '--nnodes', '2', '--master-addr', '127.0.0.1', '--master-port', String(port), ...extra];
  const node1 = options.node1 === false ? undefined : start(runArgs([...launch, '--node-rank', '1'], options.maxNew));
  const node0 = start(runArgs([...launch, '--node-rank', '0'], options.maxNew), options.env0);
  return { node0, node1, port };
}

/** All of `procs`' rank processes (and the processes) have ended. */
async function noneLeft(procs: Proc[]): Promise<boolean> {
  const pids = procs.flatMap((p) => [p.child.pid!, ...p.ranks]);
  return until(() => pids.filter(alive).length === 0, 5000);
}

describe('kdtree run --nnodes: two nodes on one host', () => {
  it('node 0 prints the tokens of --tp 1 and of the golden reference, greedy and DDTree; node 1 exits 0', async () => {
    for (const spec of [[], ddtree]) {
      const one = runCli(runArgs(['--tp', '1', ...spec]));
      expect(one.status, one.stderr).toBe(0);
      expect(one.stdout.trim()).toBe(golden.tokens.join(', '));
      const { node0, node1 } = await twoNodes(spec);
      expect(await node0.exit, node0.stderr).toBe(0);
      expect(await node1!.exit, node1!.stderr).toBe(0);
      expect(node0.stdout.trim()).toBe(one.stdout.trim());
      expect(node0.stderr).toMatch(/16 tokens, .* on cpu \(.*, 4 ranks\)/);
      expect(node1!.stderr).toMatch(/node 1 of 2: ranks 2, 3 \(pids \d+, \d+\) joining rank 0 at 127\.0\.0\.1:\d+/);
      expect(node1!.stdout).toBe('');
      expect(node0.ranks.size, 'node 0 starts its rank 1').toBe(1);
      expect(node1!.ranks.size, 'node 1 starts ranks 2 and 3').toBe(2);
      expect(await noneLeft([node0, node1!])).toBe(true);
    }
  }, 240_000);

  it("a rank process of node 1 SIGKILLed mid-run ends the run on both nodes, naming it, and leaves no process", async () => {
    const { node0, node1 } = await twoNodes(['--cache-tokens', '512'], { maxNew: 400 });
    // mid-run: once node 0 has streamed tokens
    expect(await until(() => node0.stdout.length > 0 && /pids (\d+)/.test(node1!.stderr), 120_000), node0.stderr + node1!.stderr).toBe(true);
    const rank2 = Number(/pids (\d+)/.exec(node1!.stderr)![1]);
    const t0 = Date.now();
    process.kill(rank2, 'SIGKILL');
    expect(await node0.exit).toBe(1);
    expect(await node1!.exit).toBe(1);
    expect(Date.now() - t0).toBeLessThan(20_000);
    expect(node0.stderr).toMatch(/kdtree: error: tensor-parallel rank 2 exited \(its connection to rank 0 closed\)/);
    expect(node1!.stderr).toMatch(/kdtree: error: tensor-parallel rank 2 exited \(signal SIGKILL\)/);
    expect(node0.stdout).not.toMatch(/internal error|    at /);
    expect(await noneLeft([node0, node1!])).toBe(true);
  }, 180_000);

  it('node 0 SIGKILLed mid-run: the ranks of both nodes end, node 1 exits non-zero', async () => {
    const { node0, node1 } = await twoNodes(['--cache-tokens', '512'], { maxNew: 400 });
    expect(await until(() => node0.stdout.length > 0, 120_000), node0.stderr).toBe(true);
    const t0 = Date.now();
    node0.child.kill('SIGKILL');
    expect(await node1!.exit).toBe(1);
    expect(Date.now() - t0).toBeLessThan(20_000);
    expect(node1!.stderr).toMatch(/tensor-parallel rank [23] ended: its connection to rank 0 at 127\.0\.0\.1:\d+ closed/);
    expect(await noneLeft([node0, node1!])).toBe(true);
  }, 180_000);

  it('a node that never connects ends the run within the bound, naming the missing ranks', async () => {
    const t0 = Date.now();
    const { node0, port } = await twoNodes(['--tp-timeout', '1500'], { node1: false });
    expect(await node0.exit).toBe(1);
    expect(Date.now() - t0).toBeLessThan(30_000);
    expect(node0.stderr).toMatch(new RegExp(`kdtree: error: tensor-parallel rank 2 did not join the run at 127\\.0\\.0\\.1:${port} within 1500 ms \\(nor did ranks 3\\)`));
    expect(await noneLeft([node0])).toBe(true);
    // and a node whose rank 0 never comes ends naming it
    const alone = start(runArgs(['--tp', '2', '--nnodes', '2', '--node-rank', '1', '--master-addr', '127.0.0.1', '--master-port', String(port), '--tp-timeout', '1000']));
    expect(await alone.exit).toBe(1);
    expect(alone.stderr).toMatch(/tensor-parallel rank [23] could not join the run: rank 0 did not answer at 127\.0\.0\.1:\d+ within 1000 ms/);
    expect(await noneLeft([alone])).toBe(true);
  }, 120_000);

  it('refuses launches that cannot be, naming the flag', () => {
    const cases: [string[], RegExp][] = [
      [['--tp', '2', '--nnodes', '2'], /needs --master-addr/],
      [['--tp', '2', '--nnodes', '2', '--node-rank', '2', '--master-addr', '127.0.0.1'], /node rank 2 is not below --nnodes 2/],
      [['--tp', '2', '--node-rank', '1'], /--node-rank: needs --nnodes/],
      [['--tp', '2', '--nnodes', '2', '--master-addr', '127.0.0.1', '--ranks', 'threads'], /--ranks threads: a run over several nodes/],
      [['--tp', '2', '--nnodes', '2', '--master-addr', '127.0.0.1', '--master-port', '70000'], /--master-port: must be in \[1, 65535\]/],
    ];
    for (const [args, message] of cases) {
      const r = runCli(runArgs(args));
      expect(r.status, r.stderr).not.toBe(0);
      expect(r.stderr).toMatch(message);
      expect(r.stderr).not.toMatch(/internal error|    at /);
    }
  });
});

describe('kdtree run under torchrun: one process per rank', () => {
  async function torchrun(extra: string[], env: (rank: number) => NodeJS.ProcessEnv = () => ({})) {
    const port = await freePort();
    const procs = [3, 2, 1, 0].map((rank) => start(runArgs(extra), { RANK: String(rank), WORLD_SIZE: '4', LOCAL_RANK: String(rank % 2), MASTER_ADDR: '127.0.0.1', MASTER_PORT: String(port), ...env(rank) }));
    return procs.reverse();
  }

  it('RANK 0 prints the golden tokens, greedy and DDTree; every rank exits 0', async () => {
    for (const spec of [[], ddtree]) {
      const procs = await torchrun(spec);
      const codes = await Promise.all(procs.map((p) => p.exit));
      expect(codes, procs.map((p) => p.stderr).join('\n')).toEqual([0, 0, 0, 0]);
      expect(procs[0].stdout.trim()).toBe(golden.tokens.join(', '));
      for (const p of procs.slice(1)) expect(p.stdout).toBe('');
      expect(procs[3].stderr).toMatch(/rank 3 of 4 \(local rank 1\) joining rank 0 at 127\.0\.0\.1:\d+/);
      // each process is its rank: none starts rank processes of its own
      for (const p of procs) expect(p.ranks.size).toBe(0);
    }
  }, 240_000);

  it('a rank that exits mid-run ends every process within the bound, RANK 0 naming it', async () => {
    const t0 = Date.now();
    // the fault travels from rank 0 to rank 3 with the run's setup
    const procs = await torchrun(['--cache-tokens', '512'], (rank) => (rank === 0 ? { KDTREE_TP_FAULT: '3:collective=40:exit' } : {}));
    const codes = await Promise.all(procs.map((p) => p.exit));
    expect(codes).toEqual([1, 1, 1, 3]);
    expect(Date.now() - t0).toBeLessThan(120_000);
    expect(procs[0].stderr).toMatch(/kdtree: error: tensor-parallel rank 3 exited \(its connection to rank 0 closed\)/);
    expect(procs[1].stderr).toMatch(/tensor-parallel rank 1 ended: its connection to rank 0 at 127\.0\.0\.1:\d+ closed/);
    expect(await noneLeft(procs)).toBe(true);
  }, 180_000);
});
