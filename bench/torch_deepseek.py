"""PyTorch reference of megatron-rs's multi-latent attention decoder for side-by-side benchmarks
(bench/compare.sh MLA): transformers' DeepseekV3ForCausalLM built from a config (random init, no
download), every layer dense (first_k_dense_replace = layers) so the comparison is MLA's
attention on the same SwiGLU decoder: query latent, key/value latent, heads of content + rotary
features, RMSNorm, untied output. AdamW (betas 0.9/0.95, wd 0.1 on matrices only), grad
clipping 1.0; fp32 eager (SDPA attention), or bf16 autocast. Data: random token batches.
Prints one JSON line: median step seconds, tokens/s, peak RSS.
"""
import argparse, json, resource, statistics, time
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--q-lora", type=int, default=384)
    p.add_argument("--kv-lora", type=int, default=256)
    p.add_argument("--qk-head-dim", type=int, default=64)
    p.add_argument("--rope-head-dim", type=int, default=32)
    p.add_argument("--v-head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="forward and loss under torch.autocast('cpu', bfloat16)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
        q_lora_rank=a.q_lora, kv_lora_rank=a.kv_lora, qk_nope_head_dim=a.qk_head_dim,
        qk_rope_head_dim=a.rope_head_dim, v_head_dim=a.v_head_dim, first_k_dense_replace=a.layers,
        max_position_embeddings=a.seq, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.02,
    )
    cfg._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(cfg).float().train()
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        data = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            logits = model(input_ids=data[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, a.vocab), data[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= a.warmup:
            times.append(dt)
    med = statistics.median(times)
    import transformers
    print(json.dumps({
        "impl": "pytorch-deepseek-v3-eager" + ("-autocast-bf16" if a.bf16 else ""), "step_s": med,
        "tokens_per_sec": a.batch * a.seq / med,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "first_loss": losses[0], "last_loss": losses[-1], "torch": torch.__version__,
        "transformers": transformers.__version__,
    }))


if __name__ == "__main__":
    main()
