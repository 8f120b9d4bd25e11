"""PyTorch reference of megatron-rs's GPT for side-by-side benchmarks (bench/compare.sh).

Same model as `megatron train`: learned token + position embeddings, pre-LayerNorm blocks with a
fused QKV projection, causal attention (F.scaled_dot_product_attention), GELU(tanh) MLP, final
LayerNorm, output layer tied to the word embedding; normal(0, 0.02) init with output projections
scaled by 1/sqrt(2L); AdamW (betas 0.9/0.95, wd 0.1 on matrices only), grad clipping 1.0; fp32,
eager mode, dropout 0. Data: random token batches (no data-loading cost).
Prints one JSON line: median step seconds, tokens/s, peak RSS.
"""
import argparse, json, math, resource, statistics, time
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h, heads, ffn, layers):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h, eps=1e-5)
        self.fc1 = nn.Linear(h, ffn)
        self.fc2 = nn.Linear(ffn, h)
        for lin, std in ((self.qkv, 0.02), (self.proj, 0.02 / math.sqrt(2 * layers)),
                         (self.fc1, 0.02), (self.fc2, 0.02 / math.sqrt(2 * layers))):
            nn.init.normal_(lin.weight, 0.0, std)
            nn.init.zeros_(lin.bias)

    def forward(self, x):
        b, t, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, self.heads, 3, h // self.heads)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        nn.init.normal_(self.wpe.weight, 0.0, 0.02)
        self.blocks = nn.ModuleList(Block(h, heads, 4 * h, layers) for _ in range(layers))
        self.lnf = nn.LayerNorm(h, eps=1e-5)

    def forward(self, idx, labels):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="forward and loss under torch.autocast('cpu', bfloat16)")
    p.add_argument("--profile", action="store_true", help="after the timed steps, one more under torch.profiler: its top ops by self CPU time")
    p.add_argument("--muon", metavar="EO_DIR", help="Muon (NVIDIA emerging-optimizers' `Muon`, unpacked in EO_DIR; megatron-core's "
                   "defaults: momentum 0.9, quintic x 5, bf16 products, spectral scale) on every 2-D parameter but the word "
                   "embedding, AdamW on the rest, as megatron-core's --optimizer muon routes them")
    p.add_argument("--muon-kind", default="muon", choices=["muon", "adaptive_muon"],
                   help="adaptive_muon: emerging-optimizers' AdaptiveMuon (adamuon, beta2 0.95, eps 1e-8)")
    p.add_argument("--muon-prec", default="medium", choices=["medium", "high"],
                   help="Muon's fp32_matmul_prec: medium = bf16 Newton-Schulz products (megatron-core's default), high = f32")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab)
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95))
    if a.muon:
        import sys, typing
        typing.override = getattr(typing, "override", lambda f: f)  # emerging-optimizers on Python 3.11
        sys.path.insert(0, a.muon)
        from emerging_optimizers.orthogonalized_optimizers.muon import Muon
        from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon
        word = model.wte.weight
        matrices = [p_ for p_ in decay if p_ is not word]
        if a.muon_kind == "adaptive_muon":
            muon = AdaptiveMuon(matrices, lr=3e-4, momentum=0.9, weight_decay=0.1, fp32_matmul_prec=a.muon_prec,
                                moment2_method="adamuon", beta2=0.95, eps=1e-8)
        else:
            muon = Muon(matrices, lr=3e-4, momentum=0.9, weight_decay=0.1, fp32_matmul_prec=a.muon_prec)
        adam = torch.optim.AdamW([{"params": [word], "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95))

        class Both:
            def zero_grad(self, set_to_none=True):
                muon.zero_grad(set_to_none=set_to_none)
                adam.zero_grad(set_to_none=set_to_none)

            def step(self):
                muon.step()
                adam.step()
        opt = Both()
    g = torch.Generator().manual_seed(1)
    times, losses = [], []

    def train_step():
        data = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t0, loss.item()

    for step in range(a.warmup + a.steps):
        dt, loss = train_step()
        losses.append(loss)
        if step >= a.warmup:
            times.append(dt)
    if a.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train_step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    med = statistics.median(times)
    print(json.dumps({
        "impl": "pytorch-eager" + ("-autocast-bf16" if a.bf16 else "") + (f"-{a.muon_kind}" if a.muon else ""), "step_s": med, "tokens_per_sec": a.batch * a.seq / med,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "first_loss": losses[0], "last_loss": losses[-1], "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
