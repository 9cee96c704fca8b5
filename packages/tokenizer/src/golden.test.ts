import { createHash } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { loadTokenizer } from './load.js';
import { KIMI_PAT_STR, kimiEncodeChunks } from './pattern.js';
import { GOLDEN_PATH, fixtureDir } from './test-support/fixtures.js';
import type { ChatMessage, ChatTool } from './chat-template.js';

/** tools/fixtures/gen_tokenizer_fixtures.py's output (schema kdtree.tokenizer-golden/1). */
interface Golden {
  schema: string;
  tiktoken: string;
  pat_str: string;
  tokenizers: {
    name: string;
    tiktoken_model_sha256: string;
    num_base_tokens: number;
    encode: { name: string; text: string; ids: number[]; ids_no_special: number[]; decoded: string }[];
    encode_long: { name: string; prefix: string; unit: string; times: number; suffix: string; length: number; pieces: number; count: number; ids_sha256: string; head: number[]; tail: number[] }[];
    decode: { name: string; ids: number[]; text: string }[];
    chat: { name: string; messages: ChatMessage[]; tools: ChatTool[] | null; add_generation_prompt: boolean; template_args: Record<string, unknown>; text: string; ids: number[] }[];
  }[];
}

const present = existsSync(GOLDEN_PATH);
if (!present) {
  console.error(
    `\n!!! ${GOLDEN_PATH} is missing: the golden-vector comparison with Python tiktoken is SKIPPED.\n` +
      '!!! Generate it: python3 tools/fixtures/gen_tokenizer_fixtures.py --tokenizer synthetic-8192=packages/tokenizer/fixtures/synthetic-8192 --out packages/tokenizer/fixtures/golden/tokenizer-golden.json\n',
  );
}
const golden: Golden = present ? JSON.parse(readFileSync(GOLDEN_PATH, 'utf8')) : { schema: '', tiktoken: '', pat_str: '', tokenizers: [] };
const sha256 = (text: string | Buffer) => createHash('sha256').update(text).digest('hex');

describe.skipIf(!present)('golden vectors from Python tiktoken', () => {
  it('were made with the same pattern and cover at least the synthetic tokenizer', () => {
    expect(golden.schema).toBe('kdtree.tokenizer-golden/1');
    expect(golden.pat_str).toBe(KIMI_PAT_STR);
    expect(golden.tokenizers.map((t) => t.name)).toContain('synthetic-8192');
  });

  for (const g of golden.tokenizers) {
    describe(g.name, async () => {
      const dir = fixtureDir(g.name);
      const tokenizer = await loadTokenizer(dir);

      it('uses the ranks file the vectors were made from', () => {
        expect(sha256(readFileSync(join(dir, 'tiktoken.model'))), 'tiktoken.model changed since the golden vectors were generated: regenerate them').toBe(g.tiktoken_model_sha256);
        expect(tokenizer.numBaseTokens).toBe(g.num_base_tokens);
      });

      it('encodes every text to the same ids, with special tokens parsed and as ordinary text', () => {
        for (const c of g.encode) {
          expect(tokenizer.encode(c.text), c.name).toEqual(c.ids);
          expect(tokenizer.encode(c.text, { allowSpecial: false }), `${c.name} (no special)`).toEqual(c.ids_no_special);
          expect(tokenizer.decode(c.ids), `${c.name} (decode)`).toBe(c.decoded);
        }
        // the set exercises both modes: some text differs when special tokens are not parsed
        expect(g.encode.some((c) => c.ids.join() !== c.ids_no_special.join())).toBe(true);
      });

      it("splits long inputs exactly as Kimi's encode (400,000 characters, runs of 25,000)", () => {
        for (const c of g.encode_long) {
          const text = c.prefix + c.unit.repeat(c.times) + c.suffix;
          expect([...text].length, c.name).toBe(c.length);
          const ids = tokenizer.encode(text);
          expect(ids.length, c.name).toBe(c.count);
          expect(ids.slice(0, 16), c.name).toEqual(c.head);
          expect(ids.slice(-16), c.name).toEqual(c.tail);
          expect(sha256(ids.join(',')), c.name).toBe(c.ids_sha256);
          expect([...kimiEncodeChunks(text)].length, `${c.name}: pieces after the splits`).toBe(c.pieces);
          // every case that is split is cut inside a piece, so encoding without the splits fails it
          if (c.pieces > 1) expect(tokenizer.encodeUnsplit(text).join(',') !== ids.join(','), `${c.name}: the splits change the ids`).toBe(true);
        }
        for (const pieces of [1, 2]) expect(g.encode_long.some((c) => c.pieces === pieces), `a case with ${pieces} piece(s)`).toBe(true);
      });

      it('decodes bytes that are not whole UTF-8 characters as Python does (errors="replace")', () => {
        for (const c of g.decode) {
          expect(tokenizer.decode(c.ids), c.name).toBe(c.text);
          const stream = tokenizer.streamDecoder();
          expect(c.ids.map((id) => stream.push(id)).join('') + stream.flush(), `${c.name} (streamed)`).toBe(c.text);
        }
      });

      it('renders every conversation exactly as Python Jinja renders the template, and encodes it the same', () => {
        expect(g.chat.length).toBeGreaterThan(0);
        for (const c of g.chat) {
          const text = tokenizer.renderChat(c.messages, { tools: c.tools ?? undefined, addGenerationPrompt: c.add_generation_prompt, templateArgs: c.template_args });
          expect(text, c.name).toBe(c.text);
          expect(tokenizer.encodeChat(c.messages, { tools: c.tools ?? undefined, addGenerationPrompt: c.add_generation_prompt, templateArgs: c.template_args }), c.name).toEqual(c.ids);
        }
      });
    });
  }
});
