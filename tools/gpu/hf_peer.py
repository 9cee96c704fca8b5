"""HF transformers' DeepseekV3 in bf16 on the engine benchmark's model (tools/gpu/engine-bench.ts):
the same architecture and sizes (Kimi K2's dimensions, KDTREE_BENCH_LAYERS layers), random bf16
weights (transformers has no INT4 W4A16 path for these experts; it reads 4x the expert bytes),
greedy decode tokens/s after a 64-token prompt, and the prefill of 2048 tokens.
  python3 hf_peer.py OUT.json EXPERTS[,EXPERTS...]   (the first that fits in memory is kept)"""
import json, os, sys, time
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

out_path = sys.argv[1]
layers = int(os.environ.get("KDTREE_BENCH_LAYERS", "4"))
results = {"torch": torch.__version__, "layers": layers, "runs": []}
try:
    import transformers
    results["transformers"] = transformers.__version__
except Exception:
    pass


def config(experts):
    return DeepseekV3Config(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=experts, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.827, rms_norm_eps=1e-5, rope_theta=50000.0,
        max_position_embeddings=262144,
        rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, torch_dtype="bfloat16",
    )


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return r, time.perf_counter() - t


for experts in [int(e) for e in sys.argv[2].split(",")]:
    run = {"experts": experts}
    try:
        torch.manual_seed(0)
        with torch.device("cuda"):
            torch.set_default_dtype(torch.bfloat16)
            model = DeepseekV3ForCausalLM(config(experts)).eval()
        run["parameters"] = sum(p.numel() for p in model.parameters())
        gen = torch.Generator(device="cuda").manual_seed(1)
        prompt = torch.randint(0, 163840, (1, 64), device="cuda", generator=gen)
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
            _, t_prefill = timed(lambda: model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False))
            n = 32
            _, t_all = timed(lambda: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False))
            run["decodeTokensPerSecond"] = (n - 1) / max(1e-9, t_all - t_prefill)
            long = torch.randint(0, 163840, (1, 2048), device="cuda", generator=gen)
            model(long[:, :256])
            _, t_long = timed(lambda: model(long))
            run["prefill2048Ms"] = t_long * 1000
        run["ok"] = True
        results["runs"].append(run)
        print(json.dumps(run))
        del model
        torch.cuda.empty_cache()

    except torch.cuda.OutOfMemoryError as e:
        run["ok"] = False
        run["error"] = f"out of memory: {str(e)[:200]}"
        results["runs"].append(run)
        print(json.dumps(run))
        model = None
        torch.cuda.empty_cache()
json.dump(results, open(out_path, "w"), indent=1)
