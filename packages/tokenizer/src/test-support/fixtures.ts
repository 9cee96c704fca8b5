import { fileURLToPath } from 'node:url';

/** The committed synthetic tokenizer directory (vocabulary 8192, the k2-mini preset's). */
export const SYNTHETIC_8192_DIR = fileURLToPath(new URL('../../fixtures/synthetic-8192', import.meta.url));
/** The golden vectors written by tools/fixtures/gen_tokenizer_fixtures.py. */
export const GOLDEN_PATH = fileURLToPath(new URL('../../fixtures/golden/tokenizer-golden.json', import.meta.url));
export const fixtureDir = (name: string): string => fileURLToPath(new URL(`../../fixtures/${name}`, import.meta.url));
