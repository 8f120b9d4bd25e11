"""PyTorch reference of `megatron train --model bert --transformer-block-type post_ln` for
side-by-side benchmarks (bench/bert_compare.sh): transformers' BertForPreTraining (random init,
post-LN, GELU(tanh) = `gelu_new`, SDPA attention), masked-LM + next-sentence loss, AdamW
(betas 0.9/0.999), grad clipping 1.0, fp32, eager, dropout 0. Data: random token batches with
15 % of positions labelled (no data-loading cost).
Prints one JSON line: median step seconds, tokens/s, peak RSS.
"""
import argparse, json, os, resource, statistics, time, warnings
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
warnings.filterwarnings("ignore")
import torch
import transformers
from transformers import BertConfig, BertForPreTraining


def main():
    p = argparse.ArgumentParser()
    for k in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
        p.add_argument(f"--{k}", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                     intermediate_size=4 * a.hidden, vocab_size=a.vocab, max_position_embeddings=a.seq,
                     hidden_act="gelu_new", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     attn_implementation="sdpa")
    model = BertForPreTraining(cfg).train()
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.999))
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        labels = torch.where(torch.rand(a.batch, a.seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        types = (torch.arange(a.seq) >= a.seq // 2).long().expand(a.batch, -1)
        nsp = torch.randint(0, 2, (a.batch,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, token_type_ids=types, labels=labels, next_sentence_label=nsp).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= a.warmup:
            times.append(dt)
    med = statistics.median(times)
    print(json.dumps({
        "impl": "pytorch-eager-transformers", "step_s": med, "tokens_per_sec": a.batch * a.seq / med,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "first_loss": losses[0], "last_loss": losses[-1], "torch": torch.__version__,
        "transformers": transformers.__version__,
    }))


if __name__ == "__main__":
    main()
