import { createInterface, type Interface } from 'node:readline/promises';
import { setImmediate as nextTurn } from 'node:timers/promises';
import type { Engine } from '@kdtree/engine';
import type { ChatMessage, Tokenizer } from '@kdtree/tokenizer';
import { parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliUsageError } from '../cli-error.js';
import { decodingLine, ENGINE_HELP, ENGINE_OPTIONS, ENGINE_USAGE, openEngine, parseEngineArgs } from '../engine-args.js';
import type { CommandIO } from '../io.js';
import { openTokenizer } from '../model-tokenizer.js';

export const chatSpec: CommandSpec = {
  name: 'chat',
  summary:
    "A conversation with a model in the terminal, through its chat template, each answer streaming as it decodes. Each line you type is a user turn; the thinking shows dimmed, each answer's stats go to stderr. Ctrl-C stops the answer, not the program; Ctrl-D, /exit or Ctrl-C twice on an empty line quits; /reset starts a new conversation. With standard input not a terminal, each line read is a turn.",
  usage: `kdtree chat MODEL [--system TEXT] [--max-new N] [--tokenizer DIR] ${ENGINE_USAGE}`,
  help: [
    '--system TEXT         the system prompt (default: the template\'s own)',
    '--max-new N           tokens per answer at most (default: the room left in the context)',
    "--tokenizer DIR       the tokenizer's model directory (default: the one the bundle carries, or MODEL's directory)",
    ...ENGINE_HELP,
  ],
  options: { system: { type: 'string' }, 'max-new': { type: 'string' }, tokenizer: { type: 'string' }, ...ENGINE_OPTIONS },
  positionals: [1, 1],
};

const HELP_LINE = 'Type a message and press Enter. /reset starts over, /exit (or Ctrl-D) quits; Ctrl-C stops an answer.';

type Outcome = 'done' | 'stopped' | 'cut off' | 'no room';

/** One conversation on one engine: the turns so far, and the answer being decoded (which Ctrl-C aborts). */
class Conversation {
  readonly messages: ChatMessage[] = [];
  private answering?: AbortController;

  constructor(
    private readonly engine: Engine,
    private readonly tokenizer: Tokenizer,
    private readonly decoding: ReturnType<typeof parseEngineArgs>['decoding'],
    private readonly system: string | undefined,
    private readonly maxNew: number | undefined,
    private readonly io: CommandIO,
    private readonly dim: (text: string) => string,
  ) {
    this.reset();
  }

  reset(): void {
    this.messages.length = 0;
    if (this.system !== undefined) this.messages.push({ role: 'system', content: this.system });
  }

  /** Stops the answer being decoded; false when none is. */
  interrupt(): boolean {
    if (this.answering === undefined) return false;
    this.answering.abort();
    return true;
  }

  async answer(text: string): Promise<Outcome> {
    const { engine, tokenizer, io } = this;
    this.messages.push({ role: 'user', content: text });
    const prompt = tokenizer.encodeChat(this.messages, { addGenerationPrompt: true });
    const room = engine.options.cacheTokens - prompt.length - engine.scratchSlots(this.decoding);
    if (room < 1) {
      this.messages.pop();
      io.err(`kdtree chat: the conversation is ${prompt.length} tokens with this message, the context ${engine.options.cacheTokens} (--cache-tokens): /reset starts over`);
      return 'no room';
    }
    const maxNew = Math.min(this.maxNew ?? room, room);
    const eos = [...new Set([...tokenizer.endOfTurnIds, ...engine.config.eosTokenIds])];
    const parser = tokenizer.outputParser({ endOfTurnIds: eos });
    const controller = new AbortController();
    this.answering = controller;
    let thinking = false;
    let generated = 0;
    let rate = 0;
    // the thinking streams dimmed, then the answer after a line break
    const show = (events: ReturnType<typeof parser.push>) => {
      for (const e of events) {
        if (e.type === 'reasoning') {
          io.write(this.dim(e.text));
          thinking = true;
        } else if (e.type === 'content') {
          if (thinking) io.write('\n');
          thinking = false;
          io.write(e.text);
        } else if (e.type === 'tool_call') io.write(this.dim(`[tool call ${e.name}] `));
      }
    };
    let outcome: Outcome = 'done';
    try {
      for await (const chunk of engine.generate(prompt, { maxNew, eos, ...this.decoding, signal: controller.signal })) {
        generated += chunk.tokens.length;
        show(parser.push(chunk.tokens));
        if (chunk.stats) rate = chunk.stats.tokensPerSecond;
        // the keypress (or signal) of a Ctrl-C is read between steps
        await nextTurn();
      }
      show(parser.finish());
      if (!parser.result().finished) outcome = 'cut off';
    } catch (error) {
      if (!controller.signal.aborted) throw error;
      show(parser.finish());
      outcome = 'stopped';
    } finally {
      this.answering = undefined;
    }
    const result = parser.result();
    // the answer as far as it went stays in the conversation, as the user saw it
    this.messages.push({ role: 'assistant', content: result.content });
    io.write('\n');
    const note = outcome === 'stopped' ? 'stopped' : outcome === 'cut off' ? `cut off at ${generated} tokens (--max-new)` : '';
    io.err(this.dim(`[${note ? `${note}; ` : ''}${generated} tokens${rate > 0 ? `, ${rate.toFixed(1)} tokens/s` : ''}]`));
    return outcome;
  }
}

/** Lines from a terminal (a prompt, Ctrl-C handling) or from a pipe; undefined at the end. */
interface LineSource {
  next(): Promise<string | undefined>;
  close(): void;
  /** The chat ended on a signal (exit 130), not at the end of its input. */
  readonly interrupted?: boolean;
}

function terminalLines(rl: Interface, conversation: Conversation, io: CommandIO): LineSource {
  let asking: AbortController | undefined;
  let lastEmptyInterrupt = 0;
  let closed = false;
  rl.on('close', () => {
    closed = true;
    asking?.abort();
  });
  // readline in raw mode gets Ctrl-C as a key, not a signal: an answer stops; at the prompt the
  // line clears, and a second press on an empty line quits (as node's REPL does)
  rl.on('SIGINT', () => {
    if (conversation.interrupt()) return;
    const empty = rl.line === '';
    if (empty && Date.now() - lastEmptyInterrupt < 2000) {
      rl.close();
      return;
    }
    lastEmptyInterrupt = empty ? Date.now() : 0;
    process.stdout.write('\n');
    if (empty) io.err('(To exit, press Ctrl-C again or Ctrl-D, or type /exit)');
    asking?.abort();
  });
  return {
    async next() {
      for (;;) {
        if (closed) return undefined;
        asking = new AbortController();
        try {
          return await rl.question('> ', { signal: asking.signal });
        } catch (error) {
          if ((error as Error).name !== 'AbortError') throw error;
        }
      }
    },
    close: () => rl.close(),
  };
}

function pipedLines(rl: Interface, conversation: Conversation): LineSource {
  const lines = rl[Symbol.asyncIterator]();
  // no terminal: Ctrl-C is a signal; it stops the answer being decoded, else it ends the chat
  const source = {
    interrupted: false,
    async next(): Promise<string | undefined> {
      if (source.interrupted) return undefined;
      const r = await lines.next();
      return r.done || source.interrupted ? undefined : r.value;
    },
    close: () => {
      process.off('SIGINT', onSignal);
      rl.close();
    },
  };
  const onSignal = () => {
    if (conversation.interrupt()) return;
    source.interrupted = true;
    rl.close();
  };
  process.on('SIGINT', onSignal);
  return source;
}

export async function runChat(p: Parsed, io: CommandIO): Promise<number> {
  const args = parseEngineArgs(p, 'chat');
  const maxNew = parseIntArg(p.values['max-new'] as string | undefined, '--max-new', { min: 1, max: 1 << 24 });
  const system = p.values.system as string | undefined;
  if (system === '') throw new CliUsageError('--system: give the system prompt text (or leave the option out for the template\'s own)', 'chat');
  const tokenizer = await openTokenizer((p.values.tokenizer as string | undefined) ?? p.positionals[0]);
  try {
    tokenizer.chatTemplate(); // a tokenizer without a chat template fails now, not at the first message
    const engine = await openEngine(p.positionals[0], args, io);
    try {
      const tty = Boolean(process.stdin.isTTY && process.stdout.isTTY);
      const dim = process.stdout.isTTY ? (text: string) => `\x1b[2m${text}\x1b[22m` : (text: string) => text;
      const conversation = new Conversation(engine, tokenizer, args.decoding, system, maxNew, io, dim);
      if (args.decoding.spec !== 'greedy') await engine.drafter(args.decoding.drafter ?? 'ngram');
      io.err(`kdtree chat: ${p.positionals[0]}, ${decodingLine(engine, args)}, a context of ${engine.options.cacheTokens} tokens. ${tty ? HELP_LINE : ''}`.trimEnd());
      const rl = createInterface({ input: process.stdin, output: tty ? process.stdout : undefined, terminal: tty });
      const lines = tty ? terminalLines(rl, conversation, io) : pipedLines(rl, conversation);
      try {
        for (let line = await lines.next(); line !== undefined; line = await lines.next()) {
          const text = line.trim();
          if (text === '') continue;
          if (text === '/exit' || text === '/quit') break;
          if (text === '/reset') {
            conversation.reset();
            io.err(dim('[a new conversation]'));
            continue;
          }
          if (text === '/help') {
            io.err(HELP_LINE);
            continue;
          }
          await conversation.answer(text);
        }
      } finally {
        lines.close();
      }
      return lines.interrupted ? 130 : 0;
    } finally {
      await engine.dispose();
    }
  } finally {
    tokenizer.free();
  }
}
