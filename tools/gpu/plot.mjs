#!/usr/bin/env node
// Plots a benchmark report of tools/gpu/bench.ts (bench.json) as an SVG: W4A16 and dense bf16 time
// per shape against M, with the copy-bandwidth floor of the int4 weights. No dependencies.
//   node tools/gpu/plot.mjs docs/benchmarks/data/cuda-h200.json docs/benchmarks/cuda-w4a16.svg
import { readFileSync, renameSync, writeFileSync } from 'node:fs';

const [input, output] = process.argv.slice(2);
if (!input || !output) {
  console.error('usage: node tools/gpu/plot.mjs BENCH_JSON OUT_SVG');
  process.exit(2);
}
const report = JSON.parse(readFileSync(input, 'utf8'));
if (!Array.isArray(report.gemm) || typeof report.copyGBs !== 'number') {
  console.error(`${input}: not a bench.json report (needs "gemm" rows and "copyGBs")`);
  process.exit(1);
}
const shapes = [...new Set(report.gemm.map((r) => `${r.n}x${r.k}`))];
const colors = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd'];
const W = 860, H = 520, left = 70, right = 230, top = 40, bottom = 60;
const ms = [...new Set(report.gemm.map((r) => r.m))].sort((a, b) => a - b);
const all = report.gemm.flatMap((r) => [r.us, r.denseUs ?? r.us]);
const floorUs = (r) => ((r.n * r.k) / 2 + (r.n * r.k) / 32 * 2) / (report.copyGBs * 1e9) * 1e6;
const yMin = Math.min(...report.gemm.map(floorUs)) * 0.8, yMax = Math.max(...all) * 1.25;
const x = (m) => left + (Math.log2(m) / Math.log2(ms.at(-1))) * (W - left - right);
const y = (us) => top + (1 - (Math.log10(us) - Math.log10(yMin)) / (Math.log10(yMax) - Math.log10(yMin))) * (H - top - bottom);
const path = (pts) => pts.map(([m, us], i) => `${i ? 'L' : 'M'}${x(m).toFixed(1)},${y(us).toFixed(1)}`).join(' ');
const out = [];
out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" font-family="sans-serif" font-size="12">`);
out.push(`<rect width="${W}" height="${H}" fill="white"/>`);
out.push(`<text x="${left}" y="22" font-size="14">W4A16 GEMM (bf16 x, int4 g32) vs dense bf16 (torch/cuBLAS) on ${report.device?.name ?? 'GPU'}: time per call, log-log</text>`);
for (const m of ms) {
  out.push(`<line x1="${x(m)}" y1="${top}" x2="${x(m)}" y2="${H - bottom}" stroke="#eee"/>`);
  out.push(`<text x="${x(m)}" y="${H - bottom + 18}" text-anchor="middle">${m}</text>`);
}
for (let e = Math.ceil(Math.log10(yMin)); e <= Math.floor(Math.log10(yMax)); e++) {
  for (const f of [1, 2, 5]) {
    const v = f * 10 ** e;
    if (v < yMin || v > yMax) continue;
    out.push(`<line x1="${left}" y1="${y(v)}" x2="${W - right}" y2="${y(v)}" stroke="#eee"/>`);
    out.push(`<text x="${left - 6}" y="${y(v) + 4}" text-anchor="end">${v}</text>`);
  }
}
out.push(`<text x="${(left + W - right) / 2}" y="${H - 18}" text-anchor="middle">M (rows of x)</text>`);
out.push(`<text x="18" y="${(top + H - bottom) / 2}" transform="rotate(-90 18 ${(top + H - bottom) / 2})" text-anchor="middle">microseconds</text>`);
shapes.forEach((shape, i) => {
  const rows = report.gemm.filter((r) => `${r.n}x${r.k}` === shape).sort((a, b) => a.m - b.m);
  const c = colors[i % colors.length];
  out.push(`<path d="${path(rows.map((r) => [r.m, r.us]))}" fill="none" stroke="${c}" stroke-width="2"/>`);
  if (rows.every((r) => r.denseUs)) out.push(`<path d="${path(rows.map((r) => [r.m, r.denseUs]))}" fill="none" stroke="${c}" stroke-width="1.5" stroke-dasharray="6 4"/>`);
  out.push(`<path d="${path(rows.map((r) => [r.m, floorUs(r)]))}" fill="none" stroke="${c}" stroke-width="1" stroke-dasharray="1 3"/>`);
  const ly = top + 10 + i * 44;
  out.push(`<line x1="${W - right + 15}" y1="${ly}" x2="${W - right + 45}" y2="${ly}" stroke="${c}" stroke-width="2"/>`);
  out.push(`<text x="${W - right + 50}" y="${ly + 4}">${shape} W4A16</text>`);
  out.push(`<line x1="${W - right + 15}" y1="${ly + 16}" x2="${W - right + 45}" y2="${ly + 16}" stroke="${c}" stroke-dasharray="6 4"/>`);
  out.push(`<text x="${W - right + 50}" y="${ly + 20}">dense bf16 / int4 floor ···</text>`);
});
out.push('</svg>');
writeFileSync(`${output}.tmp`, `${out.join('\n')}\n`);
renameSync(`${output}.tmp`, output);
console.log(`wrote ${output}`);
