/**
 * The entry of a tensor-parallel rank process: forked by rank 0's TpGroup (KDTREE_TP_RANK: the
 * rank's whole setup) or by another node's launcher (KDTREE_TP_JOIN: only where rank 0 is, the
 * setup is asked of it). See tp-launch.ts.
 */
import { writeSync } from 'node:fs';
import { joinRun, serveRankProcess, type RankJoin } from './tp-launch.js';
import type { RankProcessData } from './tp.js';

const given = process.env.KDTREE_TP_RANK;
const join = process.env.KDTREE_TP_JOIN;
if (given === undefined && join === undefined) throw new Error('tp-process: started without KDTREE_TP_RANK or KDTREE_TP_JOIN (TpGroup or startNodeRanks forks it)');
process.on('disconnect', () => process.exit(1));
try {
  serveRankProcess(given !== undefined ? (JSON.parse(given) as RankProcessData) : await joinRun(JSON.parse(join!) as RankJoin));
} catch (error) {
  // a rank that could not join: one line, as the CLI reports errors, and its node names it too
  writeSync(2, `kdtree: error: ${error instanceof Error ? error.message : String(error)}\n`);
  process.exit(1);
}
