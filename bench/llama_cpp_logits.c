// llama.cpp's logits for given token ids: the outside reference for `megatron convert --to gguf`
// on models without a vocabulary (the tiny test fixtures). Prints one line of vocabulary-size
// floats per position. Build against llama.cpp's build tree:
//   cc -O2 bench/llama_cpp_logits.c -I$LLAMA_CPP/include -I$LLAMA_CPP/ggml/include \
//      -L$LLAMA_CPP/build/bin -lllama -Wl,-rpath,$LLAMA_CPP/build/bin -o llama_cpp_logits
// Usage: llama_cpp_logits MODEL.gguf ID...
#include <stdio.h>
#include <stdlib.h>
#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void * data) {
    (void) level; (void) text; (void) data;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf ID...\n", argv[0]);
        return 2;
    }
    int n = argc - 2;
    if (!getenv("LLAMA_LOG")) llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n; cp.n_batch = n; cp.n_ubatch = n; cp.n_threads = 2; cp.n_threads_batch = 2;
    // An f32 KV cache: the default f16 one rounds K and V (a 1e-3 relative error in logits).
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    // Flash attention on CPU rounds Q to f16.
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = atoi(argv[i + 2]);
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < n; i++) {
        const float * l = llama_get_logits_ith(ctx, i);
        for (int v = 0; v < nv; v++) printf(v ? " %.7g" : "%.7g", l[v]);
        printf("\n");
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
