// The repository's workspace packages, read from pnpm-workspace.yaml's globs (one level: dir/*).
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

export const ROOT = fileURLToPath(new URL('../..', import.meta.url));

export function readJson(path) {
  return JSON.parse(readFileSync(path, 'utf8'));
}

/** Every workspace package: { dir (absolute), rel (from the root), manifest }. */
export function workspacePackages(root = ROOT) {
  const globs = readFileSync(join(root, 'pnpm-workspace.yaml'), 'utf8')
    .split('\n')
    .map((l) => /^\s*-\s*['"]?([^'"]+?)\/\*['"]?\s*$/.exec(l)?.[1])
    .filter(Boolean);
  const found = [];
  for (const parent of globs) {
    const base = join(root, parent);
    if (!existsSync(base)) continue;
    for (const name of readdirSync(base).sort()) {
      const manifest = join(base, name, 'package.json');
      if (existsSync(manifest)) found.push({ dir: join(base, name), rel: `${parent}/${name}`, manifest: readJson(manifest) });
    }
  }
  return found;
}

/** The packages that are published (not private). */
export function publicPackages(root = ROOT) {
  return workspacePackages(root).filter((p) => !p.manifest.private);
}

/** Platform packages carry a prebuilt variant: package.json's `kdtree.variant`. */
export function platformPackages(root = ROOT) {
  return publicPackages(root).filter((p) => p.manifest.kdtree?.variant);
}
