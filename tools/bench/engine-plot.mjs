#!/usr/bin/env node
// The engine benchmark's plot (docs/benchmarks/engine.md): the verify cost curve (ms of a tree
// step against its nodes, log-log) beside a decode step and the time a step would take at the
// copy bandwidth, from docs/benchmarks/data/engine-h200-bench.json.
//   node tools/bench/engine-plot.mjs [bench.json] [out.svg]
import { readFileSync, renameSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const root = fileURLToPath(new URL('../..', import.meta.url));
const input = process.argv[2] ?? `${root}docs/benchmarks/data/engine-h200-bench.json`;
const output = process.argv[3] ?? `${root}docs/benchmarks/engine-verify-curve.svg`;
const bench = JSON.parse(readFileSync(input, 'utf8'));
const model = bench.models.find((m) => m.verifyCurve);
const points = Object.entries(model.verifyCurve.verifyMs).map(([b, ms]) => [Number(b) + 1, ms]);
const decode = model.verifyCurve.decodeMs;
const floor = model.floorMs;
const [W, H, L, R, T, B] = [640, 400, 60, 20, 30, 50];
const xs = (n) => L + (Math.log2(n) / Math.log2(257)) * (W - L - R);
const maxMs = Math.max(...points.map((p) => p[1])) * 1.1;
const ys = (ms) => H - B - (Math.log10(ms / 0.5) / Math.log10(maxMs / 0.5)) * (H - T - B);
const line = (pts, color, dash = '') => `<polyline fill="none" stroke="${color}" stroke-width="2" ${dash ? `stroke-dasharray="${dash}"` : ''} points="${pts.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(' ')}"/>`;
const parts = [
  `<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" font-family="sans-serif" font-size="12">`,
  `<rect width="${W}" height="${H}" fill="white"/>`,
  `<text x="${W / 2}" y="18" text-anchor="middle" font-size="14">Tree verify vs decode step: ${bench.layers} layers at Kimi K2's dimensions, ${model.experts} experts, ${bench.device.name}</text>`,
  ...[1, 2, 4, 8, 16, 32, 64, 128, 256].map((n) => `<line x1="${xs(n)}" x2="${xs(n)}" y1="${T}" y2="${H - B}" stroke="#eee"/><text x="${xs(n)}" y="${H - B + 16}" text-anchor="middle">${n}</text>`),
  ...[0.5, 1, 2, 5, 10, 20, 40].filter((v) => v < maxMs).map((v) => `<line x1="${L}" x2="${W - R}" y1="${ys(v)}" y2="${ys(v)}" stroke="#eee"/><text x="${L - 6}" y="${ys(v) + 4}" text-anchor="end">${v}</text>`),
  `<text x="${W / 2}" y="${H - 12}" text-anchor="middle">nodes verified (root + budget)</text>`,
  `<text x="16" y="${H / 2}" transform="rotate(-90 16 ${H / 2})" text-anchor="middle">ms per step</text>`,
  line(points.map(([n, ms]) => [xs(n), ys(ms)]), '#1f77b4'),
  ...points.map(([n, ms]) => `<circle cx="${xs(n).toFixed(1)}" cy="${ys(ms).toFixed(1)}" r="3" fill="#1f77b4"/>`),
  line([[xs(1), ys(decode)], [xs(257), ys(decode)]], '#d62728', '6 4'),
  line([[xs(1), ys(floor)], [xs(257), ys(floor)]], '#2ca02c', '2 4'),
  `<text x="${xs(2)}" y="${ys(decode) - 6}" fill="#d62728">decode step ${decode.toFixed(2)} ms</text>`,
  `<text x="${xs(2)}" y="${ys(floor) + 16}" fill="#2ca02c">floor: a decode step's bytes at the copy bandwidth, ${floor.toFixed(2)} ms</text>`,
  `<text x="${xs(12)}" y="${ys(points[points.length - 1][1]) + 4}" fill="#1f77b4">tree step (build + verify + accept + commit)</text>`,
  '</svg>',
];
writeFileSync(`${output}.tmp`, `${parts.join('\n')}\n`);
renameSync(`${output}.tmp`, output);
console.log(`wrote ${output}`);
