/** An error the CLI prints as one line and exits with `exitCode` (2: bad usage, 1: failure). */
export class CliError extends Error {
  constructor(
    message: string,
    readonly exitCode = 1,
  ) {
    super(message);
    this.name = 'CliError';
  }
}

export class CliUsageError extends CliError {
  constructor(message: string, readonly command?: string) {
    super(message, 2);
    this.name = 'CliUsageError';
  }
}
