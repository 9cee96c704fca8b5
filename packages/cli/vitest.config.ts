import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['src/**/*.test.ts'],
    testTimeout: 60_000,
    // hooks write synthetic models (gen-model) while other files run rank processes: on a loaded
    // two-core machine that can take well over the default 10 s
    hookTimeout: 120_000,
  },
});
