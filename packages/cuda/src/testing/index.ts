import { ATTENTION_CHECKS } from './attention-checks.js';
import { BINDING_CHECKS } from './binding-checks.js';
import { DDTREE_CHECKS } from './ddtree-checks.js';
import { ENVIRONMENT_CHECKS } from './environment-checks.js';
import { EPILOGUE_CHECKS } from './epilogue-checks.js';
import { FLOAT_GEMM_CHECKS } from './float-gemm-checks.js';
import { FUZZ_CHECKS } from './fuzz-checks.js';
import { GEMM_CHECKS } from './gemm-checks.js';
import { GQA_ATTENTION_CHECKS } from './gqa-attention-checks.js';
import { GRAPH_CHECKS } from './graph-checks.js';
import type { KernelCheck } from './harness.js';
import { MEMORY_CHECKS } from './memory-checks.js';
import { MOE_BF16_CHECKS } from './moe-bf16-checks.js';
import { OPS_CHECKS } from './ops-checks.js';

export { CheckFailure, type CheckResult, type KernelCheck } from './harness.js';

/** Every kernel check, in the order a report lists them; the fuzz last, as a device fault would break the checks after it. */
export const ALL_CHECKS: KernelCheck[] = [...MEMORY_CHECKS, ...GEMM_CHECKS, ...EPILOGUE_CHECKS, ...FLOAT_GEMM_CHECKS, ...MOE_BF16_CHECKS, ...ATTENTION_CHECKS, ...GQA_ATTENTION_CHECKS, ...OPS_CHECKS, ...DDTREE_CHECKS, ...GRAPH_CHECKS, ...BINDING_CHECKS, ...ENVIRONMENT_CHECKS, ...FUZZ_CHECKS];
