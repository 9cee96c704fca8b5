import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['src/**/*.test.ts', 'scripts/**/*.test.mjs'],
    testTimeout: 300_000,
    hookTimeout: 300_000,
  },
});
