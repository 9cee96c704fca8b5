import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { RequestQueue } from './request-queue.js';

export type Endpoint = 'chat' | 'completions' | 'models' | 'health' | 'metrics' | 'other';

/**
 * The server's Prometheus metrics, on a registry of its own (so that two servers in one process
 * do not share counters): requests by endpoint and status, prompt and generated tokens, time to
 * first token, decoding rate, tokens per step (the accepted length of speculative decoding, 1 for
 * greedy), the queue, cancellations; and prom-client's process metrics (memory, CPU, event-loop
 * lag, which a long prefill shows).
 */
export class ServerMetrics {
  readonly registry = new Registry();
  readonly requests = new Counter({ name: 'kdtree_requests_total', help: 'HTTP requests answered, by endpoint and status code', labelNames: ['endpoint', 'status'] as const, registers: [this.registry] });
  readonly promptTokens = new Counter({ name: 'kdtree_prompt_tokens_total', help: 'Prompt tokens of the generations run', registers: [this.registry] });
  readonly generationTokens = new Counter({ name: 'kdtree_generation_tokens_total', help: 'Tokens generated', registers: [this.registry] });
  readonly timeToFirstToken = new Histogram({
    name: 'kdtree_time_to_first_token_seconds',
    help: 'From the request arriving to its first generated token (queueing and prefill included)',
    buckets: [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120],
    registers: [this.registry],
  });
  readonly tokensPerSecond = new Histogram({
    name: 'kdtree_tokens_per_second',
    help: "Each generation's decoding rate: tokens after the first per second of decoding",
    buckets: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
    registers: [this.registry],
  });
  readonly acceptedPerStep = new Histogram({
    name: 'kdtree_accepted_tokens_per_step',
    help: 'Tokens a decode step emitted: accepted draft tokens plus the bonus token (1 for greedy)',
    buckets: [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32],
    registers: [this.registry],
  });
  readonly requestDuration = new Histogram({
    name: 'kdtree_request_duration_seconds',
    help: 'From a generation request arriving to its last byte, by endpoint',
    labelNames: ['endpoint'] as const,
    buckets: [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300],
    registers: [this.registry],
  });
  readonly cancelled = new Counter({
    name: 'kdtree_generations_cancelled_total',
    help: 'Generations stopped before their end, by reason (client_disconnect, shutdown)',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });

  constructor(queue: RequestQueue) {
    new Gauge({ name: 'kdtree_queue_depth', help: 'Requests waiting for the engine', registers: [this.registry], collect() { this.set(queue.waiting); } });
    new Gauge({ name: 'kdtree_requests_running', help: 'Requests generating now (the engine runs one sequence at a time)', registers: [this.registry], collect() { this.set(queue.running ? 1 : 0); } });
    new Gauge({ name: 'kdtree_queue_capacity', help: 'Requests the server holds at once, generating or waiting (--max-concurrency)', registers: [this.registry], collect() { this.set(queue.capacity); } });
    collectDefaultMetrics({ register: this.registry, prefix: 'kdtree_' });
  }
}
