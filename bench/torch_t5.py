"""PyTorch reference of `megatron train --model t5 --normalization RMSNorm --disable-bias-linear`
for side-by-side benchmarks (bench/t5_compare.sh): transformers' T5ForConditionalGeneration
(random init, non-gated GELU(tanh) = `gelu_new`, relative position buckets, tied embeddings,
SDPA-free eager attention as transformers implements T5), span-corruption-shaped batches
(encoder and decoder lengths as given, random tokens), AdamW, clipping 1.0, fp32, dropout 0.
Prints one JSON line: median step seconds, tokens/s (encoder + decoder tokens), peak RSS.
"""
import argparse, json, os, resource, statistics, time, warnings
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
warnings.filterwarnings("ignore")
import torch
import transformers
from transformers import T5Config, T5ForConditionalGeneration


def main():
    p = argparse.ArgumentParser()
    for k in ("layers", "hidden", "heads", "enc", "dec", "batch", "vocab"):
        p.add_argument(f"--{k}", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = T5Config(num_layers=a.layers, num_decoder_layers=a.layers, num_heads=a.heads, d_model=a.hidden,
                   d_kv=a.hidden // a.heads, d_ff=4 * a.hidden, vocab_size=a.vocab, feed_forward_proj="gelu_new",
                   dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(cfg).train()
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.999))
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        enc = torch.randint(0, a.vocab, (a.batch, a.enc), generator=g)
        dec = torch.randint(0, a.vocab, (a.batch, a.dec), generator=g)
        labels = torch.randint(0, a.vocab, (a.batch, a.dec), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=enc, decoder_input_ids=dec, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= a.warmup:
            times.append(dt)
    med = statistics.median(times)
    print(json.dumps({
        "impl": "pytorch-eager-transformers", "step_s": med, "tokens_per_sec": a.batch * (a.enc + a.dec) / med,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "first_loss": losses[0], "last_loss": losses[-1], "torch": torch.__version__,
        "transformers": transformers.__version__,
    }))


if __name__ == "__main__":
    main()
