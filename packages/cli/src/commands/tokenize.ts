import { readFile } from 'node:fs/promises';
import type { CommandSpec, Parsed } from '../args.js';
import { CliError, CliUsageError } from '../cli-error.js';
import { json, type CommandIO } from '../io.js';
import { openTokenizer } from '../model-tokenizer.js';

const MODEL_HELP = 'MODEL                 a model directory (tiktoken.model, tokenizer_config.json) or a KDTR bundle carrying its tokenizer';

export const tokenizeSpec: CommandSpec = {
  name: 'tokenize',
  summary: "Encode text into token ids with a model's tokenizer (Kimi's tiktoken BPE and pre-tokenizer). Special-token text such as <|im_end|> becomes the special token, as Kimi's tokenizer does, unless --no-special.",
  usage: 'kdtree tokenize MODEL "TEXT" | --file F [--no-special] [--json]',
  help: [
    MODEL_HELP,
    '--file F              encode the UTF-8 text of file F (- for standard input) instead of TEXT',
    '--no-special          encode special-token text as ordinary text',
    '--json                print {"schema": "kdtree.tokenize/1", "ids": [...]}',
  ],
  options: { file: { type: 'string' }, 'no-special': { type: 'boolean' }, json: { type: 'boolean' } },
  positionals: [1, 2],
};

export const detokenizeSpec: CommandSpec = {
  name: 'detokenize',
  summary: "Decode token ids into text with a model's tokenizer; bytes that are not valid UTF-8 become U+FFFD.",
  usage: 'kdtree detokenize MODEL IDS [--skip-special] [--json]',
  help: [
    MODEL_HELP,
    'IDS                   token ids separated by commas or spaces: 1,2,3',
    '--skip-special        leave out the special tokens marked special (as skip_special_tokens)',
    '--json                print {"schema": "kdtree.detokenize/1", "text": "..."}',
  ],
  options: { 'skip-special': { type: 'boolean' }, json: { type: 'boolean' } },
  positionals: [2, 2],
};

async function readText(file: string): Promise<string> {
  const bytes = file === '-' ? await readStdin() : await readFile(file);
  try {
    return new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    throw new CliError(`${file === '-' ? 'standard input' : file}: not valid UTF-8 text`);
  }
}

async function readStdin(): Promise<Uint8Array> {
  const chunks: Buffer[] = [];
  for await (const chunk of process.stdin) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks);
}

export async function runTokenize(p: Parsed, io: CommandIO): Promise<number> {
  const [model, text] = p.positionals;
  const file = p.values.file as string | undefined;
  if ((text === undefined) === (file === undefined)) throw new CliUsageError(`tokenize: give the text or --file F, not ${text === undefined ? 'neither' : 'both'}\nusage: ${tokenizeSpec.usage}`, 'tokenize');
  const input = text ?? (await readText(file!));
  const tokenizer = await openTokenizer(model, 'as MODEL');
  const ids = tokenizer.encode(input, { allowSpecial: !p.values['no-special'] });
  io.out(p.values.json ? json({ schema: 'kdtree.tokenize/1', ids }) : ids.join(','));
  return 0;
}

/** "1,2, 3" or "1 2 3" -> [1, 2, 3]; anything else names the element. */
export function parseIds(text: string, vocabSize: number): number[] {
  const parts = text.trim() === '' ? [] : text.trim().split(/\s*,\s*|\s+/);
  return parts.map((part, i) => {
    if (!/^\d+$/.test(part)) throw new CliUsageError(`detokenize: IDS element ${i + 1} '${part}' is not a token id (expected non-negative integers separated by commas)`, 'detokenize');
    const id = Number(part);
    if (id >= vocabSize) throw new CliError(`detokenize: token id ${id} (element ${i + 1}) is outside the vocabulary [0, ${vocabSize})`);
    return id;
  });
}

export async function runDetokenize(p: Parsed, io: CommandIO): Promise<number> {
  const [model, idsText] = p.positionals;
  const tokenizer = await openTokenizer(model, 'as MODEL');
  const ids = parseIds(idsText, tokenizer.vocabSize);
  const text = tokenizer.decode(ids, { skipSpecial: Boolean(p.values['skip-special']) });
  io.out(p.values.json ? json({ schema: 'kdtree.detokenize/1', text }) : text);
  return 0;
}
