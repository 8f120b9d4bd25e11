"""PyTorch reference of megatron-rs's gpt-oss for side-by-side benchmarks (bench/compare.sh
GPTOSS): transformers' GptOssForCausalLM built from a config (random init, no download) at a
scaled-down gpt-oss shape: RMSNorm, grouped-query attention with learned sinks (eager: the
implementation transformers has for sinks on CPU; it has no SDPA path for them), a 128-token
window on every other layer, YaRN, biases on every projection, routed experts with the clamped,
offset Quick-GEGLU and biases, untied output layer. AdamW (betas 0.9/0.95, wd 0.1 on matrices
only), grad clipping 1.0, fp32 eager, or bf16 autocast (--bf16). Data: random token batches.
Prints one JSON line: median step seconds, tokens/s, peak RSS.
"""
import argparse, json, resource, statistics, time
import torch
from transformers import GptOssConfig, GptOssForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
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
    cfg = GptOssConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, head_dim=a.hidden // a.heads,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        num_local_experts=a.experts, num_experts_per_tok=a.topk, sliding_window=a.window,
        max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
        tie_word_embeddings=False, attention_bias=True, initializer_range=0.02,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
    )
    cfg._attn_implementation = "eager"
    model = GptOssForCausalLM(cfg).float().train()
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2 and "bias" not in n]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2 or "bias" in n]
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
        "impl": "pytorch-gpt-oss-eager" + ("-autocast-bf16" if a.bf16 else ""), "step_s": med,
        "tokens_per_sec": a.batch * a.seq / med,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "first_loss": losses[0], "last_loss": losses[-1], "torch": torch.__version__,
        "transformers": transformers.__version__,
    }))


if __name__ == "__main__":
    main()
