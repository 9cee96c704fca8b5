import { describe, expect, it } from 'vitest';
import { ChatTemplate, deepSortKeys, type ChatMessage } from './chat-template.js';
import { kimiChatTemplate } from './synthetic.js';

const kimi = new ChatTemplate(kimiChatTemplate(), 'kimi-k2.jinja');

describe("the Kimi K2 template (the synthetic models')", () => {
  it('writes the turns, the default system prompt and the generation prompt', () => {
    expect(kimi.render([{ role: 'user', content: 'Hi' }], { addGenerationPrompt: true })).toBe(
      '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>',
    );
  });

  it('declares the tools first as compact JSON with sorted keys, then the calls and their results', () => {
    const messages: ChatMessage[] = [
      { role: 'system', content: 'S' },
      { role: 'user', content: 'Weather?' },
      { role: 'assistant', content: '', reasoning_content: 'use the tool', tool_calls: [{ id: 'functions.get_weather:0', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris"}' } }] },
      { role: 'tool', tool_call_id: 'functions.get_weather:0', content: '18C' },
    ];
    const text = kimi.render(messages, { tools: [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }], addGenerationPrompt: true });
    expect(text).toBe(
      '<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"get_weather","parameters":{"properties":{"city":{"type":"string"}},"type":"object"}},"type":"function"}]<|im_end|>' +
        '<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>Weather?<|im_end|>' +
        '<|im_assistant|>assistant<|im_middle|><think>use the tool</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city":"Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>' +
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|><|im_assistant|>assistant<|im_middle|>',
    );
    expect(kimi.render(messages.slice(0, 2), { tools: [{ type: 'function', function: { name: 'f', parameters: { b: 1, a: 2 } } }], sortToolKeys: false })).toContain('{"type":"function","function":{"name":"f","parameters":{"b":1,"a":2}}}');
  });

  it('keeps reasoning only in the turns after the last plain assistant answer (a tool round in progress)', () => {
    const call = { id: 'functions.f:0', type: 'function' as const, function: { name: 'f', arguments: '{}' } };
    const text = kimi.render([
      { role: 'user', content: 'Q1' },
      { role: 'assistant', content: 'A1', reasoning_content: 'dropped 1' },
      { role: 'user', content: 'Q2' },
      { role: 'assistant', content: 'A2', reasoning_content: 'dropped 2' },
      { role: 'user', content: 'Q3' },
      { role: 'assistant', content: '', reasoning_content: 'kept', tool_calls: [call] },
      { role: 'tool', tool_call_id: 'functions.f:0', content: 'r' },
    ]);
    expect(text).toContain('<think></think>A1');
    expect(text).toContain('<think></think>A2');
    expect(text).toContain('<think>kept</think><|tool_calls_section_begin|>');
    expect(text).not.toContain('dropped');
  });
});

describe('ChatTemplate', () => {
  it('reports a template that does not parse or fails to render, naming it', () => {
    expect(() => new ChatTemplate('{% for %}', 'm/chat_template.jinja')).toThrow(/^m\/chat_template\.jinja: the template does not parse/);
    const t = new ChatTemplate("{{ raise_exception('no system role') }}", 'm/t.jinja');
    expect(() => t.render([])).toThrow(/^m\/t\.jinja: rendering failed: no system role/);
  });

  it('passes the template arguments and globals', () => {
    const t = new ChatTemplate('{{ bos_token }}{{ thinking }}{{ add_generation_prompt }}', 't', { bos_token: '[BOS]' });
    expect(t.render([], { templateArgs: { thinking: 'T' } })).toBe('[BOS]Tfalse');
  });

  it('rejects malformed messages and tools with the path of the bad field', () => {
    const bad = (messages: unknown, message: RegExp, tools?: unknown) => expect(() => kimi.render(messages as ChatMessage[], { tools: tools as never })).toThrow(message);
    bad({}, /^messages: not an array/);
    bad([null], /^messages\[0\]: not an object/);
    bad([{ role: '' }], /^messages\[0\]\.role: not a role/);
    bad([{ role: 'user', content: 5 }], /^messages\[0\]\.content: not content; expected a string, an array of parts or null, found 5/);
    bad([{ role: 'user', content: [{ type: 'text' }] }], /^messages\[0\]\.content\[0\]\.text: not a string/);
    bad([{ role: 'user', content: [{ text: 'x' }] }], /^messages\[0\]\.content\[0\]: not a content part/);
    bad([{ role: 'user', name: 3 }], /^messages\[0\]\.name: not a string/);
    bad([{ role: 'assistant', reasoning_content: 1 }], /^messages\[0\]\.reasoning_content: not a string/);
    bad([{ role: 'assistant', tool_calls: {} }], /^messages\[0\]\.tool_calls: not an array/);
    bad([{ role: 'assistant', tool_calls: [{ function: { name: '', arguments: '{}' } }] }], /^messages\[0\]\.tool_calls\[0\]\.function\.name: not a function name/);
    bad([{ role: 'assistant', tool_calls: [{ function: { name: 'f', arguments: 3 } }] }], /^messages\[0\]\.tool_calls\[0\]\.function\.arguments: not arguments/);
    bad([], /^tools\[0\]: not a tool declaration/, [{ type: 'function' }]);
  });
});

describe('deepSortKeys', () => {
  it('sorts every object by code point, as Python sorted() does, and keeps arrays in order', () => {
    expect(JSON.stringify(deepSortKeys({ b: [{ z: 1, a: 2 }], a: { d: 1, c: 2 } }))).toBe('{"a":{"c":2,"d":1},"b":[{"a":2,"z":1}]}');
    // U+FF5E sorts before U+1F600 by code point but after it by UTF-16 unit
    expect(Object.keys(deepSortKeys({ '😀': 1, '～': 2 }))).toEqual(['～', '😀']);
  });
});
