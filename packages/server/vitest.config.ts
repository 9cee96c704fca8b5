import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['src/**/*.test.ts'],
    // the synthetic k2-mini model (with its tokenizer) every test file serves, written once
    globalSetup: ['src/test-support/global-setup.ts'],
    testTimeout: 60_000,
  },
});
