/** Process checks for the tests of rank processes: none may outlive its run. */
import { existsSync, readdirSync, readFileSync } from 'node:fs';

/**
 * This process's children that are rank processes (forked tp-process.js), from /proc (Linux; []
 * elsewhere, see hasProc): how a test sees the ranks of a createEngine that failed, which returns
 * no engine to ask for its rankPids. A child exited but not yet reaped (state Z) is not counted.
 */
export function rankChildren(): number[] {
  if (!hasProc) return [];
  const out: number[] = [];
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const stat = readFileSync(`/proc/${entry}/stat`, 'utf8');
      const [state, ppid] = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
      if (Number(ppid) !== process.pid || state === 'Z') continue;
      if (readFileSync(`/proc/${entry}/cmdline`, 'utf8').includes('tp-process')) out.push(Number(entry));
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

/** Whether rankChildren can see processes. */
export const hasProc = existsSync('/proc/self/stat');

/** Whether process `pid` is still there. */
export function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** Waits up to `ms` for `check` to hold. */
export async function until(check: () => boolean, ms: number): Promise<boolean> {
  for (const t0 = Date.now(); Date.now() - t0 < ms; ) {
    if (check()) return true;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  return check();
}
