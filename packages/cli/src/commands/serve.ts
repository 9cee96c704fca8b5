import { basename } from 'node:path';
import { createServer } from '@kdtree/server';
import { parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliError, CliUsageError } from '../cli-error.js';
import { decodingLine, ENGINE_HELP, ENGINE_OPTIONS, ENGINE_USAGE, openEngine, parseEngineArgs } from '../engine-args.js';
import type { CommandIO } from '../io.js';
import { openTokenizer } from '../model-tokenizer.js';

export const serveSpec: CommandSpec = {
  name: 'serve',
  summary:
    "Serve a model over an OpenAI-compatible HTTP API: POST /v1/chat/completions (streaming, tools, reasoning_content) and /v1/completions, GET /v1/models, /health and /metrics (Prometheus). The engine decodes one sequence at a time: requests wait in line, up to --max-concurrency; greedy decoding only (temperature 0), speculative decoding as for run. Ctrl-C or SIGTERM shuts down gracefully: requests in flight finish (a second Ctrl-C cancels them). See docs/serving.md.",
  usage: `kdtree serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-concurrency N] [--model-name NAME] [--tokenizer DIR] ${ENGINE_USAGE}`,
  help: [
    '--host HOST           the address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface)',
    '--port N              the port (default 8000; 0 picks a free one, printed at start)',
    '--api-key KEY         require Authorization: Bearer KEY on /v1/ (default: $KDTREE_API_KEY; /health and /metrics stay open)',
    '--max-concurrency N   requests held at once, the one generating and those waiting; one more gets a 429 (default 16)',
    "--model-name NAME     the model id clients send (default: MODEL's file name without .kdtr)",
    "--tokenizer DIR       the tokenizer's model directory (default: the one the bundle carries, or MODEL's directory)",
    '--grace-seconds S     at shutdown, how long requests in flight may finish before they are cancelled (default 30)',
    ...ENGINE_HELP,
    '-q, --quiet           no line per request on stderr',
  ],
  options: {
    host: { type: 'string' },
    port: { type: 'string' },
    'api-key': { type: 'string' },
    'max-concurrency': { type: 'string' },
    'model-name': { type: 'string' },
    tokenizer: { type: 'string' },
    'grace-seconds': { type: 'string' },
    ...ENGINE_OPTIONS,
    quiet: { type: 'boolean', short: 'q' },
  },
  positionals: [1, 1],
};

/** The model id from the path: `models/k2-mini.kdtr` -> `k2-mini`, a directory -> its name. */
export function defaultModelName(path: string): string {
  return basename(path.replace(/[/\\]+$/, '')).replace(/\.kdtr(\.json)?$/i, '') || 'model';
}

export async function runServe(p: Parsed, io: CommandIO): Promise<number> {
  const model = p.positionals[0];
  const host = (p.values.host as string | undefined) ?? '127.0.0.1';
  const port = parseIntArg(p.values.port as string | undefined, '--port', { min: 0, max: 65535 }) ?? 8000;
  const maxConcurrency = parseIntArg(p.values['max-concurrency'] as string | undefined, '--max-concurrency', { min: 1, max: 65536 }) ?? 16;
  const graceSeconds = parseIntArg(p.values['grace-seconds'] as string | undefined, '--grace-seconds', { min: 0, max: 86400 }) ?? 30;
  const apiKey = (p.values['api-key'] as string | undefined) ?? (process.env.KDTREE_API_KEY || undefined);
  if (apiKey !== undefined && !/^\S+$/.test(apiKey)) throw new CliUsageError('--api-key: expected a key without spaces', 'serve');
  const modelName = (p.values['model-name'] as string | undefined) ?? defaultModelName(model);
  if (modelName === '') throw new CliUsageError('--model-name: expected a non-empty name', 'serve');
  const args = parseEngineArgs(p, 'serve');
  const quiet = Boolean(p.values.quiet);
  const say = (line: string) => io.err(`kdtree serve: ${line}`);
  const tokenizer = await openTokenizer((p.values.tokenizer as string | undefined) ?? model);
  try {
    const engine = await openEngine(model, args, io);
    try {
      say(`warming up: ${decodingLine(engine, args)}`);
      const server = await createServer({ engine, tokenizer, modelName, apiKey, maxConcurrency, decoding: args.decoding, log: quiet ? undefined : say });
      try {
        await server.listen({ host, port });
      } catch (error) {
        const code = (error as NodeJS.ErrnoException).code;
        await server.close({ graceMs: 0 });
        if (code === 'EADDRINUSE') throw new CliError(`--port ${port}: ${host}:${port} is already in use (another server?); choose another port, or 0 for a free one`);
        if (code === 'EADDRNOTAVAIL' || code === 'ENOTFOUND') throw new CliError(`--host ${host}: not an address of this machine`);
        if (code === 'EACCES') throw new CliError(`--port ${port}: permission denied (ports below 1024 need privileges)`);
        throw error;
      }
      say(`model '${modelName}' at ${server.url}/v1 (OpenAI API), ${server.url}/health, ${server.url}/metrics; a context of ${engine.options.cacheTokens} tokens, up to ${maxConcurrency} requests at once${apiKey ? ', API key required' : ''}`);
      await new Promise<void>((resolve) => {
        let signals = 0;
        const onSignal = (signal: NodeJS.Signals) => {
          signals++;
          if (signals === 1) {
            say(`${signal}: shutting down; ${server.inFlight} request(s) in flight finish (up to ${graceSeconds} s; press Ctrl-C again to cancel them)`);
            server.close({ graceMs: graceSeconds * 1000 }).then(() => {
              process.off('SIGINT', onSignal);
              process.off('SIGTERM', onSignal);
              resolve();
            });
          } else {
            say(`${signal}: cancelling ${server.inFlight} request(s)`);
            server.cancelAll();
          }
        };
        process.on('SIGINT', onSignal);
        process.on('SIGTERM', onSignal);
      });
      say('stopped');
      return 0;
    } finally {
      await engine.dispose();
    }
  } finally {
    tokenizer.free();
  }
}
