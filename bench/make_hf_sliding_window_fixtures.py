"""Tiny random Hugging Face models with sliding-window attention, for the `megatron convert`
tests of `--window-size`: `mistral_swa` (MistralConfig, sliding_window 5: each token sees itself
and 4 earlier ones, on every layer) and `qwen2_swa` (Qwen2 with use_sliding_window,
sliding_window 4 and max_window_layers 1: layer 0 full attention, layer 1 windowed), 16 tokens
per sequence so the windows bind. Same recipe as make_hf_fixtures.py (offline, fixed seeds,
every tensor perturbed); reference.safetensors holds the inputs and fp32 logits.
Usage: .venv-ref/bin/python bench/make_hf_sliding_window_fixtures.py
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96

models = {
    "mistral_swa": lambda: MistralForCausalLM(MistralConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, sliding_window=5)),
    "qwen2_swa": lambda: Qwen2ForCausalLM(Qwen2Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
        max_window_layers=1)),
}
unwindowed = {
    "mistral_swa": lambda: MistralForCausalLM(MistralConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, sliding_window=None)),
    "qwen2_swa": lambda: Qwen2ForCausalLM(Qwen2Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False)),
}
for name, make in models.items():
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 16), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().contiguous()
    d = os.path.join(out, name)
    model.save_pretrained(d)
    p = os.path.join(d, "generation_config.json")
    if os.path.exists(p):
        os.remove(p)
    save_file({"input_ids": ids, "logits": logits}, os.path.join(d, "reference.safetensors"))
    # The window must matter: the same weights with full attention give other logits.
    full = unwindowed[name]().eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        other = full(input_ids=ids).logits.float()
    print(name, tuple(logits.shape), "max |windowed - full| logits:",
          float((logits - other).abs().max()), model.config.to_dict().get("layer_types"))
