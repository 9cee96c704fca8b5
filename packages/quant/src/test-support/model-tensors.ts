/** Tensor names of a small DeepSeek-V3 / Kimi K2 layout: one dense layer, one MoE layer. */
export function k2LikeTensors(prefix = 'model.'): { name: string; shape: number[] }[] {
  const t: { name: string; shape: number[] }[] = [{ name: `${prefix}embed_tokens.weight`, shape: [64, 32] }];
  for (const l of [0, 1]) {
    const p = `${prefix}layers.${l}.`;
    t.push({ name: `${p}input_layernorm.weight`, shape: [32] });
    for (const a of ['q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj']) t.push({ name: `${p}self_attn.${a}.weight`, shape: [32, 32] });
    if (l === 0) {
      for (const m of ['gate_proj', 'up_proj', 'down_proj']) t.push({ name: `${p}mlp.${m}.weight`, shape: [64, 32] });
    } else {
      t.push({ name: `${p}mlp.gate.weight`, shape: [4, 32] });
      t.push({ name: `${p}mlp.gate.e_score_correction_bias`, shape: [4] });
      for (const e of [0, 1, 2, 3]) for (const m of ['gate_proj', 'up_proj', 'down_proj']) t.push({ name: `${p}mlp.experts.${e}.${m}.weight`, shape: [32, 32] });
      for (const m of ['gate_proj', 'up_proj', 'down_proj']) t.push({ name: `${p}mlp.shared_experts.${m}.weight`, shape: [32, 32] });
    }
  }
  t.push({ name: `${prefix}norm.weight`, shape: [32] }, { name: 'lm_head.weight', shape: [64, 32] });
  return t;
}
