import { readFile, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { TokenizerError } from './errors.js';
import { Tokenizer, type TokenizerFiles } from './tokenizer.js';

/**
 * Loads a model directory's tokenizer as Kimi ships it: tiktoken.model, tokenizer_config.json and,
 * when present, chat_template.jinja.
 */
export async function loadTokenizer(dir: string): Promise<Tokenizer> {
  const info = await stat(dir).catch((error: NodeJS.ErrnoException) => {
    throw new TokenizerError('KDTREE_TOKENIZER_FILE', error.code === 'ENOENT' ? 'no such directory' : error.message, { source: dir, cause: error });
  });
  if (!info.isDirectory()) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'not a directory', { source: dir, expected: 'a model directory with tiktoken.model and tokenizer_config.json' });
  const read = async (name: string, required: boolean): Promise<Uint8Array | undefined> => {
    try {
      return await readFile(join(dir, name));
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code === 'ENOENT' && !required) return undefined;
      const what = (error as NodeJS.ErrnoException).code === 'ENOENT' ? 'is missing' : `cannot be read (${(error as Error).message})`;
      throw new TokenizerError('KDTREE_TOKENIZER_FILE', `${name} ${what}`, { source: dir, expected: 'a model directory with tiktoken.model and tokenizer_config.json', cause: error });
    }
  };
  const files: TokenizerFiles = { 'tiktoken.model': (await read('tiktoken.model', true))!, 'tokenizer_config.json': (await read('tokenizer_config.json', true))! };
  const template = await read('chat_template.jinja', false);
  if (template !== undefined) files['chat_template.jinja'] = template;
  return new Tokenizer(files, { source: dir });
}

/** The key of a KDTR bundle's metadata that carries its tokenizer. */
export const TOKENIZER_METADATA_KEY = 'tokenizer';
export const TOKENIZER_METADATA_SCHEMA = 'kdtree.tokenizer/1';

/**
 * How a KDTR bundle carries its tokenizer: under metadata key `tokenizer`, the files verbatim as
 * strings (all three are UTF-8 text; Kimi's tiktoken.model is 2.8 MB, far inside the header limit,
 * and the header checksum covers it). See docs/tokenizer.md.
 */
export interface TokenizerMetadata {
  schema: typeof TOKENIZER_METADATA_SCHEMA;
  files: { 'tiktoken.model': string; 'tokenizer_config.json': string; 'chat_template.jinja'?: string };
}

const text = new TextDecoder('utf-8', { fatal: true });

/** The metadata entry for these files (checked by building a tokenizer from them first). */
export function tokenizerMetadata(files: TokenizerFiles): TokenizerMetadata {
  const tokenizer = new Tokenizer(files, { source: 'tokenizer metadata' });
  tokenizer.free();
  const asText = (v: string | Uint8Array) => (typeof v === 'string' ? v : text.decode(v));
  const out: TokenizerMetadata = { schema: TOKENIZER_METADATA_SCHEMA, files: { 'tiktoken.model': asText(files['tiktoken.model']), 'tokenizer_config.json': asText(files['tokenizer_config.json']) } };
  if (files['chat_template.jinja'] !== undefined) out.files['chat_template.jinja'] = asText(files['chat_template.jinja']);
  return out;
}

/** The tokenizer a bundle's metadata carries, or undefined when it carries none. */
export function tokenizerFromMetadata(metadata: Readonly<Record<string, unknown>>, source = 'bundle'): Tokenizer | undefined {
  const entry = metadata[TOKENIZER_METADATA_KEY];
  if (entry === undefined) return undefined;
  const field = `metadata.${TOKENIZER_METADATA_KEY}`;
  if (typeof entry !== 'object' || entry === null || (entry as { schema?: unknown }).schema !== TOKENIZER_METADATA_SCHEMA) {
    throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'not a tokenizer entry', { source, field, expected: `{"schema": "${TOKENIZER_METADATA_SCHEMA}", "files": {...}}`, actual: JSON.stringify(entry)?.slice(0, 100) });
  }
  const files = (entry as { files?: unknown }).files;
  if (typeof files !== 'object' || files === null) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'no files', { source, field: `${field}.files` });
  for (const name of ['tiktoken.model', 'tokenizer_config.json', 'chat_template.jinja'] as const) {
    const v = (files as Record<string, unknown>)[name];
    if (v === undefined && name === 'chat_template.jinja') continue;
    if (typeof v !== 'string') throw new TokenizerError('KDTREE_TOKENIZER_FILE', `${name} is not a string`, { source, field: `${field}.files.${name}` });
  }
  return new Tokenizer(files as TokenizerFiles, { source: `${source}: ${field}` });
}
