export { main, COMMANDS, reportError } from './main.js';
export { CliError, CliUsageError } from './cli-error.js';
export { Progress } from './progress.js';
export type { CommandIO } from './io.js';
