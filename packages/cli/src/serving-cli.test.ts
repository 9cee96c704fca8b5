/**
 * `kdtree serve`, `kdtree run --text` and `kdtree chat` as a user runs them, on a k2-mini model
 * made by `kdtree gen-model` (with the tokenizer it carries): the official `openai` client against
 * the served model, its tokens equal to `kdtree run`'s, chat answers equal to the server's, Ctrl-C
 * in chat (piped and on a pseudo-terminal), the API key, shutdown on SIGTERM.
 */
import { spawn, spawnSync, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { runCli } from './test-support/run-cli.js';

const BIN = fileURLToPath(new URL('../dist/bin.js', import.meta.url));
const dir = mkdtempSync(join(tmpdir(), 'kdtree-serving-'));
const model = join(dir, 'm.kdtr');
const tiny = join(dir, 'tiny.kdtr');
const ENGINE = ['--backend', 'cpu', '--cache-tokens', '512'];
const children = new Set<ChildProcessWithoutNullStreams>();

afterAll(() => {
  for (const c of children) c.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

beforeAll(() => {
  for (const [preset, out] of [['k2-mini', model], ['tiny', tiny]]) {
    const r = runCli(['gen-model', '--preset', preset, '--quant', 'kimi-k2', '-o', out, '-q']);
    expect(r.status, r.stderr).toBe(0);
  }
});

interface Running {
  child: ChildProcessWithoutNullStreams;
  output: () => { stdout: string; stderr: string };
  /** Resolves with the exit code. */
  exited: Promise<number | null>;
}

function start(args: string[], env: NodeJS.ProcessEnv = {}): Running {
  const child = spawn(process.execPath, [BIN, ...args], { env: { ...process.env, ...env } });
  children.add(child);
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (d) => (stdout += d));
  child.stderr.on('data', (d) => (stderr += d));
  const exited = new Promise<number | null>((resolve) => child.on('exit', (code) => (children.delete(child), resolve(code))));
  return { child, output: () => ({ stdout, stderr }), exited };
}

async function until<T>(probe: () => T | undefined, what: string, r: Running, ms = 60_000): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const v = probe();
    if (v !== undefined) return v;
    if (Date.now() > end || r.child.exitCode !== null) throw new Error(`no ${what}; stderr: ${r.output().stderr}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

/** Starts `kdtree serve` on a free port; its base URL once it listens. */
async function serve(args: string[] = [], env: NodeJS.ProcessEnv = {}): Promise<Running & { url: string }> {
  const r = start(['serve', model, ...ENGINE, '--port', '0', ...args], env);
  const url = await until(() => /model '[^']+' at (http:\/\/[\d.:]+)\/v1/.exec(r.output().stderr)?.[1], 'listening line', r);
  return { ...r, url };
}

/** What `kdtree chat` prints on stdout (not a terminal) for a streamed answer: thinking, a line break, the content. */
async function shownAnswer(client: OpenAI, messages: OpenAI.ChatCompletionMessageParam[], maxTokens: number): Promise<string> {
  const stream = await client.chat.completions.create({ model: 'm', messages, max_tokens: maxTokens, stream: true });
  let shown = '';
  let thinking = false;
  for await (const chunk of stream) {
    const d = chunk.choices[0]?.delta as (OpenAI.ChatCompletionChunk.Choice.Delta & { reasoning_content?: string }) | undefined;
    if (d?.reasoning_content) {
      shown += d.reasoning_content;
      thinking = true;
    }
    if (d?.content) {
      if (thinking) shown += '\n';
      thinking = false;
      shown += d.content;
    }
    for (const call of d?.tool_calls ?? []) if (call.function?.name) shown += `[tool call ${call.function.name}] `;
  }
  return `${shown}\n`;
}

describe('kdtree serve, run --text and chat on a generated model', () => {
  let server: Running & { url: string };
  let client: OpenAI;
  beforeAll(async () => {
    server = await serve(['--max-concurrency', '4']);
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
  });

  it('answers the openai client; its tokens and text equal kdtree run --text on the same prompt', async () => {
    expect((await client.models.list()).data.map((m) => m.id)).toEqual(['m']);
    const prompt = 'The tokenizer reads 中文 and English:';
    const r = await client.completions.create({ model: 'm', prompt, max_tokens: 12, return_token_ids: true } as OpenAI.CompletionCreateParamsNonStreaming);
    const choice = r.choices[0] as OpenAI.CompletionChoice & { token_ids: number[] };
    const run = runCli(['run', model, '--text', prompt, '--max-new', '12', ...ENGINE, '--json']);
    expect(run.status, run.stderr).toBe(0);
    const ran = JSON.parse(run.stdout);
    expect(choice.token_ids).toEqual(ran.tokens);
    expect(choice.text).toBe(ran.text);
    expect(ran.prompt).toEqual(JSON.parse(runCli(['tokenize', model, prompt, '--json']).stdout).ids);
    // streamed, run prints the same text
    const streamed = runCli(['run', model, '--text', prompt, '--max-new', '12', ...ENGINE]);
    expect(streamed.stdout).toBe(`${ran.text}\n`);
    // and ddtree speculation, and the model split over two tensor-parallel ranks, give the same tokens
    const spec = JSON.parse(runCli(['run', model, '--text', prompt, '--max-new', '12', ...ENGINE, '--spec', 'ddtree', '--budget', '8', '--json']).stdout);
    expect(spec.tokens).toEqual(ran.tokens);
    const tp = JSON.parse(runCli(['run', model, '--text', prompt, '--max-new', '12', ...ENGINE, '--tp', '2', '--json']).stdout);
    expect([tp.tokens, tp.stats.tp]).toEqual([ran.tokens, 2]);

    const chat = await client.chat.completions.create({ model: 'm', messages: [{ role: 'user', content: 'Hi' }], max_tokens: 8 });
    expect(chat.choices[0].message.role).toBe('assistant');
    expect(chat.usage?.completion_tokens).toBeGreaterThan(0);
  });

  it('chat with piped input: one answer per line, equal to the server chat answers; /reset starts over', async () => {
    const sys = 'You are terse.';
    const first = await shownAnswer(client, [{ role: 'system', content: sys }, { role: 'user', content: 'Hi' }], 8);
    const fresh = await shownAnswer(client, [{ role: 'system', content: sys }, { role: 'user', content: 'Hello' }], 8);
    const r = spawnSync(process.execPath, [BIN, 'chat', model, ...ENGINE, '--system', sys, '--max-new', '8'], { input: 'Hi\n\n/reset\nHello\n', encoding: 'utf8' });
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toBe(first + fresh);
    expect(r.stderr).toMatch(/kdtree chat: .*greedy on cpu/);
    expect(r.stderr).toMatch(/\[a new conversation\]/);
    expect(r.stderr.match(/\[(cut off at 8 tokens \(--max-new\); )?\d+ tokens, [\d.]+ tokens\/s\]/g)).toHaveLength(2);
  });

  it('chat: Ctrl-C (SIGINT, input piped) stops the answer, not the program', async () => {
    const r = start(['chat', model, ...ENGINE]);
    r.child.stdin.write('Tell me a long story.\n');
    await until(() => (r.output().stdout.length > 0 ? true : undefined), 'answer', r);
    r.child.kill('SIGINT');
    await until(() => (/\[stopped; \d+ tokens/.test(r.output().stderr) ? true : undefined), 'stop line', r);
    // the chat goes on: it reads the next line
    r.child.stdin.end('/reset\n');
    expect(await r.exited).toBe(0);
    expect(r.output().stderr).toMatch(/\[stopped; \d+ tokens[^\n]*\n\[a new conversation\]/);
    const stopped = Number(/\[stopped; (\d+) tokens/.exec(r.output().stderr)![1]);
    expect(stopped).toBeLessThan(400);
  });

  const hasScript = spawnSync('script', ['--version']).status === 0;
  it.skipIf(!hasScript)('chat on a terminal (script(1) gives it a pseudo-terminal): Ctrl-C stops the answer; twice on an empty line quits', async () => {
    const command = [process.execPath, BIN, 'chat', model, ...ENGINE].map((a) => `'${a}'`).join(' ');
    const child = spawn('script', ['-qfec', command, '/dev/null']);
    children.add(child);
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    const exited = new Promise<number | null>((resolve) => child.on('exit', (code) => (children.delete(child), resolve(code))));
    const running: Running = { child, output: () => ({ stdout: out, stderr: out }), exited };
    await until(() => (/> /.test(out) ? true : undefined), 'prompt', running);
    child.stdin.write('Tell me a long story\r');
    await until(() => (/story\r*\n[^\r\n]/.test(out) ? true : undefined), 'answer', running);
    child.stdin.write('\x03');
    await until(() => (/\[stopped; \d+ tokens\]/.test(out) ? true : undefined), 'stop line', running);
    await until(() => (/\[stopped[^\n]*\n[^]*> /.test(out) ? true : undefined), 'the next prompt', running);
    child.stdin.write('\x03');
    await until(() => (/To exit, press Ctrl-C again/.test(out) ? true : undefined), 'exit hint', running);
    child.stdin.write('\x03');
    expect(await exited).toBe(0);
  });

  it('SIGTERM shuts the server down gracefully: exit 0', async () => {
    expect((await fetch(`${server.url}/health`)).status).toBe(200);
    server.child.kill('SIGTERM');
    expect(await server.exited).toBe(0);
    const { stderr } = server.output();
    expect(stderr).toMatch(/POST \/v1\/completions 200 \d+ prompt \+ 12 generated tokens/);
    expect(stderr).toMatch(/SIGTERM: shutting down/);
    expect(stderr).toMatch(/kdtree serve: stopped/);
  });
});

describe('kdtree serve options', () => {
  it('the API key (--api-key or $KDTREE_API_KEY) is enforced; a busy port and bad options get one clear line', async () => {
    const keyed = await serve([], { KDTREE_API_KEY: 'sk-local' });
    try {
      await expect(new OpenAI({ baseURL: `${keyed.url}/v1`, apiKey: 'wrong', maxRetries: 0 }).models.list()).rejects.toBeInstanceOf(OpenAI.AuthenticationError);
      expect((await new OpenAI({ baseURL: `${keyed.url}/v1`, apiKey: 'sk-local', maxRetries: 0 }).models.list()).data[0].id).toBe('m');
      const port = new URL(keyed.url).port;
      const busy = runCli(['serve', model, ...ENGINE, '--port', port]);
      expect(busy.status).toBe(1);
      expect(busy.stderr).toMatch(new RegExp(`--port ${port}: 127\\.0\\.0\\.1:${port} is already in use`));
    } finally {
      keyed.child.kill('SIGINT');
      expect(await keyed.exited).toBe(0);
    }
    const cases: [string[], number, RegExp][] = [
      [['serve', tiny, ...ENGINE], 1, /tiny\.kdtr: the bundle carries no tokenizer/],
      [['serve', model, '--port', '70000'], 2, /--port: must be in \[0, 65535\]/],
      [['serve', model, '--max-concurrency', '0'], 2, /--max-concurrency: must be in \[1, 65536\]/],
      [['serve', model, '--budget', '4'], 2, /serve: --drafter, --budget and --depth apply to --spec chain or ddtree/],
      [['serve', model, '--max-concurency', '1'], 2, /unknown option '--max-concurency' \(did you mean --max-concurrency\?\)/],
      [['chat', tiny, ...ENGINE], 1, /tiny\.kdtr: the bundle carries no tokenizer/],
      [['run', tiny, '--text', 'x', '--max-new', '2', ...ENGINE], 1, /tiny\.kdtr: the bundle carries no tokenizer \(metadata\.tokenizer\); give the model directory it came from with --tokenizer DIR/],
      [['run', model, '--text', 'x', '--prompt', '1', '--max-new', '2'], 2, /run: give --prompt IDS or --text TEXT, not both/],
    ];
    for (const [args, status, message] of cases) {
      const r = runCli(args);
      expect(r.status, `${args.join(' ')}: ${r.stderr}`).toBe(status);
      expect(r.stderr).toMatch(message);
      expect(r.stderr).not.toMatch(/internal error|    at /);
    }
  });
});
