"""A small vocabulary in Megatron's tiktoken JSON format, and what Megatron-LM's own `TikTokenizer`
makes of test texts with it, for the tests of `--tokenizer-type TikTokenizer`
(crates/megatron-data/tests/tiktoken_tokenizer.rs).

The vocabulary: the first 1,500 ranks of OpenAI's o200k_base (GPT-4o's BPE, the base of NVIDIA's
Nemotron tiktoken vocabularies), taken from the copy the tiktoken-rs crate ships, written as
Megatron's `reload_mergeable_ranks` reads it: a JSON list of {rank, token_bytes (base64),
token_str}, the 256 bytes first in byte order (as Megatron requires), then o200k_base's merged
tokens in its order. The reference is Megatron-LM's class itself: `CustomTikTokenizer` and
`reload_mergeable_ranks` as they stood in megatron/training/tokenizer/tokenizer.py before the 2025
move to megatron.core.tokenizers (commit 32570939^), read out of a Megatron-LM clone with `ast`
(its relative imports of `print_rank_0` replaced by `print`; its base class, which only records
the constructor's arguments, by an empty one) and run on the tiktoken library. Two settings:
pattern v2 with the default 1,000 special tokens, and pattern v1 with 8, one of them added by
`--tokenizer-special-tokens`. Usage, from the repository root (tiktoken installed):
python bench/make_tiktoken_fixture.py MEGATRON_LM_GIT_DIR [O200K_BASE_TIKTOKEN_FILE]
"""
import ast, base64, glob, json, os, re, subprocess, sys

COMMIT = "32570939300c4377060bc8f13c90275ea7e649fe^"
RANKS = 1500
megatron = sys.argv[1]
o200k = sys.argv[2] if len(sys.argv) > 2 else sorted(glob.glob(os.path.expanduser(
    "~/.cargo/registry/src/*/tiktoken-rs-*/assets/o200k_base.tiktoken")))[-1]
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.join(here, "..", "crates", "megatron-data", "tests", "fixtures", "tiktoken")
os.makedirs(root, exist_ok=True)


def megatron_tiktokenizer(megatron_dir):
    """Megatron-LM's CustomTikTokenizer class, as its file defines it."""
    source = subprocess.run(["git", "-C", megatron_dir, "show", COMMIT + ":megatron/training/tokenizer/tokenizer.py"],
                            capture_output=True, text=True, check=True).stdout
    wanted = {"CustomTikTokenizer", "reload_mergeable_ranks", "PATTERN_TIKTOKEN", "PATTERN_TIKTOKEN_V2"}
    body = [n for n in ast.parse(source).body
            if getattr(n, "name", None) in wanted
            or isinstance(n, ast.Assign) and any(getattr(t, "id", None) in wanted for t in n.targets)]

    class DropRelativeImports(ast.NodeTransformer):
        def visit_ImportFrom(self, node):
            return None if node.level > 0 else node

    module = ast.fix_missing_locations(DropRelativeImports().visit(ast.Module(body=body, type_ignores=[])))
    import typing, pathlib
    namespace = {"MegatronLegacyTokenizer": type("MegatronLegacyTokenizer", (), {"__init__": lambda self, *a, **k: None}),
                 "print_rank_0": print, "json": json, "base64": base64, "Path": pathlib.Path,
                 **{k: getattr(typing, k) for k in ("Dict", "List", "Optional")}}
    exec(compile(module, "megatron/training/tokenizer/tokenizer.py", "exec"), namespace)
    return namespace


def write_megatron_vocab(tiktoken_file, dest, limit=None):
    """o200k_base's `base64 rank` lines as Megatron's JSON list, which wants the 256 single bytes
    as ranks 0-255 in byte order (o200k_base ranks them in GPT-2's printable-first order): the
    bytes first, then o200k_base's longer tokens in its rank order."""
    merged = []
    for line in open(tiktoken_file, "rb"):
        token, rank = line.split()
        b = base64.b64decode(token)
        if len(b) > 1:
            merged.append((int(rank), b))
    tokens = [bytes([i]) for i in range(256)] + [b for _, b in sorted(merged)]
    tokens = tokens[:limit] if limit else tokens
    vocab = [{"rank": i, "token_bytes": base64.b64encode(b).decode(), "token_str": b.decode("utf-8", "replace")}
             for i, b in enumerate(tokens)]
    with open(dest, "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(json.dumps(v, ensure_ascii=False) for v in vocab) + "\n]\n")


if __name__ == "__main__":
    ns = megatron_tiktokenizer(megatron)
    vocab = os.path.join(root, "o200k-1500.json")
    write_megatron_vocab(o200k, vocab, RANKS)
    sotu = sorted(glob.glob(os.path.join(here, "..", "examples", "sotu", "*.txt")))
    sentences = re.split(r"(?<=[.?!]) +", open(sotu[0], encoding="utf-8").read())
    texts = ["", "Hello world", "HELLO World hello WORLD", "don't we'll they're", "1234567 + 89 = 1234656",
             "<s> literal </s> and <unk> <SPECIAL_5>", "  leading and trailing spaces  ", "line\nbreaks\r\n\n\ttabs",
             "path/to/file.rs // comment /* block */", "Ünïcödé — “quotes” and 日本語, emoji 🦙!",
             "CamelCaseWords and snake_case_words", "ÀÉÎõü ΑΒΓ αβγ",
             "नमस्ते दुनिया, यह एक परीक्षण है।", "வணக்கம் உலகம்", "আমি বাংলায় গান গাই", "cafe\u0301 nai\u0308ve"] + sentences[:4]
    for name, pattern, n_special, specials in [("v2", "v2", 1000, None), ("v1", "v1", 8, ["<unk>", "<s>", "</s>", "<mask>"])]:
        t = ns["CustomTikTokenizer"](path=vocab, pattern=ns["PATTERN_TIKTOKEN" if pattern == "v1" else "PATTERN_TIKTOKEN_V2"],
                                     vocab_size=RANKS + n_special, num_special_tokens=n_special, special_tokens=specials)
        import tiktoken
        out = {"source": "Megatron-LM %s CustomTikTokenizer on tiktoken %s" % (COMMIT, tiktoken.__version__),
               "pattern": pattern, "num_special_tokens": n_special, "special_tokens": specials,
               "vocab_size": t.vocab_size, "bos": t.bos, "eos": t.eos, "eod": t.eod,
               "cases": [{"text": s, "ids": t.tokenize(s), "decoded": t.detokenize(t.tokenize(s))} for s in texts]}
        out["cases"].append({"text": None, "ids": [0, 1, 2, 7, 5, n_special, n_special + 400], "decoded": t.detokenize([0, 1, 2, 7, 5, n_special, n_special + 400])})
        dest = os.path.join(root, "o200k-1500-%s-megatron.json" % name)
        with open(dest, "w", encoding="utf-8") as f:
            head = {k: v for k, v in out.items() if k != "cases"}
            f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n')
            f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in out["cases"]) + "\n]}\n")
        print("wrote", dest, len(out["cases"]), "cases, vocabulary", t.vocab_size)
