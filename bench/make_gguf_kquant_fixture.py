"""A GGUF of Q5_0, Q5_1 and k-quant tensors (Q2_K ... Q6_K; 2 rows of 512 values each) made by
ggml's own quantizer (`ggml_quantize_chunk` of the libggml built from the llama.cpp vendored in
the PyPI sdist llama-cpp-python==0.3.36, through ctypes), and the f32 values gguf-py's
reference dequantizer gives for them, for the `--from gguf` k-quant test.
Usage: python bench/make_gguf_kquant_fixture.py LLAMA_CPP_DIR   (after its cmake build)
"""
import ctypes, os, sys
import numpy as np
lc = sys.argv[1]
sys.path.insert(0, os.path.join(lc, "gguf-py"))
import gguf
from gguf.quants import dequantize
from safetensors.numpy import save_file

ggml = ctypes.CDLL(os.path.join(lc, "build", "bin", "libggml-base.so"))
ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
T = gguf.GGMLQuantizationType
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "megatron-training", "tests", "fixtures", "gguf")
rows, cols = 2, 512
rng = np.random.default_rng(0)
w = gguf.GGUFWriter(os.path.join(root, "k-quants.gguf"), "llama")
expected = {}
for qt in [T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
    # Weights of a trained layer: mostly small, a few outliers that stretch the scales.
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    x[rng.random((rows, cols)) < 0.01] *= 8
    block, size = gguf.GGML_QUANT_SIZES[qt]
    dst = np.zeros(rows * cols // block * size, dtype=np.uint8)
    n = ggml.ggml_quantize_chunk(int(qt), x.ctypes.data, dst.ctypes.data, 0, rows, cols, None)
    assert n == dst.size, (qt, n, dst.size)
    data = dst.reshape(rows, cols // block * size)
    w.add_tensor(f"{qt.name}.weight", data, raw_dtype=qt)
    expected[qt.name] = np.ascontiguousarray(dequantize(data, qt).reshape(rows, cols).astype(np.float32))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
save_file(expected, os.path.join(root, "k-quants-expected.safetensors"))
print("wrote", list(expected))
