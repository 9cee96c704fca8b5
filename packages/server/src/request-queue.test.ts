import { describe, expect, it } from 'vitest';
import { ApiError } from './errors.js';
import { RequestQueue } from './request-queue.js';

const signal = () => new AbortController().signal;

describe('RequestQueue', () => {
  it('runs one request at a time in arrival order, and refuses the one past its capacity with a 429', async () => {
    const q = new RequestQueue(3);
    const order: string[] = [];
    const tickets = ['a', 'b', 'c'].map((name) => ({ name, ticket: q.admit() }));
    expect(() => q.admit()).toThrow(ApiError);
    expect(() => q.admit()).toThrow(/--max-concurrency 3/);
    const runs = tickets.map(({ name, ticket }) =>
      ticket.turn(signal()).then(async () => {
        order.push(`${name} starts`);
        await new Promise((resolve) => setTimeout(resolve, 5));
        order.push(`${name} ends`);
        ticket.release();
      }),
    );
    await new Promise((resolve) => setTimeout(resolve, 1));
    expect(q.running).toBe(true);
    expect(q.waiting).toBe(2);
    await Promise.all(runs);
    expect(order).toEqual(['a starts', 'a ends', 'b starts', 'b ends', 'c starts', 'c ends']);
    expect([q.size, q.waiting, q.running]).toEqual([0, 0, false]);
    q.admit().release();
  });

  it('a waiting request that aborts leaves the line; the next one takes its place', async () => {
    const q = new RequestQueue(4);
    const a = q.admit();
    await a.turn(signal());
    const b = q.admit();
    const c = q.admit();
    const gone = new AbortController();
    const bTurn = b.turn(gone.signal);
    let cStarted = false;
    const cTurn = c.turn(signal()).then(() => (cStarted = true));
    gone.abort(new Error('client left'));
    await expect(bTurn).rejects.toThrow('client left');
    b.release();
    expect(q.waiting).toBe(1);
    a.release();
    await cTurn;
    expect(cStarted).toBe(true);
    c.release();
    expect(q.size).toBe(0);
  });

  it('after close, refuses with a 503; release twice is harmless', () => {
    const q = new RequestQueue(2);
    const t = q.admit();
    q.close('the server is shutting down');
    expect(() => q.admit()).toThrow(expect.objectContaining({ status: 503, code: 'server_shutting_down' }));
    t.release();
    t.release();
    expect(q.size).toBe(0);
  });
});
