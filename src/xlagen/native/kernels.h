// xlagen's CPU kernels: their plain C entry points, the constants shared with Python, and the conventions.
//
// Each kernel has a plain entry point here (pointers and sizes, no XLA types), which tests call from numpy
// through ctypes, and an XLA custom-call wrapper (xla_calls.cc) that parses the call's backend config and
// calls the same entry point. An entry point checks its sizes and returns nullptr when it ran, else a static
// message saying what was wrong (nothing written); the XLA wrapper turns that message into an error status.
//
// Files: simd.h (the vector operations, for AVX-512 or AVX2 with FMA), pool.{h,cc} (the thread pool and the
// read-ahead of the next float32 product), f32_product.{h,cc} (the float32 product), packed_product.cc
// (bfloat16 and int8 weights), gemm.cc (the many-row products of prompts and encoders), vector_math.h
// (maxima, exponentials, dot products), attention.cc (the encoder attention and a prompt's masked attention,
// the decoding step's self-attention, the folded cross-attention), argmax.cc, lookup.cc (a prompt's token
// embeddings from the tied output projection's layout), norm.cc (a prompt's LayerNorms), heads.cc (a cross-attention memory's heads), xla_calls.cc (the custom-call
// wrappers, registration, settings, constants). All of them are compiled into one library per instruction
// set by xlagen/native/build.py (-mavx512f or -mavx2, with -mfma); the same entry points, XLA targets,
// constants and weight layouts in both.

#ifndef XLAGEN_NATIVE_KERNELS_H_
#define XLAGEN_NATIVE_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace xlagen {

// The constants Python needs (packing layouts, limits); `xlagen_constant` gives them to xlagen/native by
// name when the library loads, so that no value is kept equal by hand.
constexpr int kPanel = 32;               // output columns per packed bfloat16 panel
constexpr int kInt8Panel = 64;           // output columns per int8 panel
constexpr int kMaxStreamM = 16;          // rows of x up to which float32 products stream (f32_product.cc)
constexpr int kStepAttentionMaxD = 256;  // head sizes the step attention takes, at most
constexpr int kMaxDefaultThreads = 8;    // worker threads by default, at most (caller included)
constexpr int kDefaultSpinMicroseconds = 600;  // the most an idle worker spins, where a core is free (pool.h)
// Bytes of the next float32 product each idle worker reads ahead, at most: they fill the core's L2 (1 MB
// here) no more than the gap between two products lets them (xlagen_configure_pool, xlagen_set_lookahead).
constexpr int kDefaultLookaheadKB = 768;
// And "lanes": the float32 lanes of a vector in this build, simd.h's kLanes (16 with AVX-512, 8 with AVX2).

}  // namespace xlagen

extern "C" {

// y[m, n] = x[m, k] @ w[k, n], float32, w row-major as XLA stores it.
const char* xlagen_f32_product(const float* x, const float* w, float* y, int m, int k, int n);
// y[m, n] = x[m, k] @ float32(W), W packed as bfloat16 words [ceil(n / kPanel), k, kPanel / 2]
// (xlagen.native.pack_bfloat16).
const char* xlagen_bf16_product(const float* x, const uint32_t* w, float* y, int m, int k, int n);
// y[m, n] = x[m, k] @ (Q * s), Q int8 with one float32 scale per column, packed in panels
// [ceil(n / kInt8Panel), k + 4, kInt8Panel] (xlagen.native.pack_int8).
const char* xlagen_int8_product(const float* x, const int8_t* w, float* y, int m, int k, int n);
// y[m, n] ~ x[m, k] @ (Q * s) in integers: x quantized to int8 per row (symmetric, scale max |x[r]| / 127),
// int32 sums of int8 x int8, y = sums * (row scale * column scale); weights as xlagen_int8_product's.
const char* xlagen_int8_integer_product(const float* x, const int8_t* w, float* y, int m, int k, int n);
// The same for many rows (prompts, encoders): x quantized to 7 bits per row with a zero point (scale
// (max(x, 0) - min(x, 0)) / 126), which multiplies in fewer instructions (packed_product.cc).
const char* xlagen_int8_many_integer_product(const float* x, const int8_t* w, float* y, int m, int k, int n);
// y = bf16(x) @ W for bfloat16 weights packed as xlagen_bf16_product's: x rounded to bfloat16, float32 sums, on
// AMX's bfloat16 tiles (refused where xlagen_amx_tiles() is 0); as the tiles do, subnormal inputs and sums
// count as zero.
const char* xlagen_bf16_tile_product(const float* x, const uint32_t* w, float* y, int m, int k, int n);
// The last two with an epilogue as y is stored: bias[n] added (y + b: the same float32 add as one after the
// call; bias may be null), then `activation` applied: 0 none, 1 ReLU, 2 GELU's tanh form (GPT-2's "gelu_new",
// computed as y / (1 + exp(-2u)), u = sqrt(2 / pi) (y + 0.044715 y^3)), then residual[m, n] added (a residual
// connection's input, the same float32 add again; may be null).
const char* xlagen_int8_many_integer_product_epilogue(const float* x, const int8_t* w, const float* bias,
                                                      int activation, const float* residual, float* y, int m, int k,
                                                      int n);
const char* xlagen_bf16_tile_product_epilogue(const float* x, const uint32_t* w, const float* bias, int activation,
                                              const float* residual, float* y, int m, int k, int n);
// 1 where xlagen_int8_many_integer_product runs on AMX's tile registers: the build has them (-mamx-int8) and
// Linux granted this process their state; else 0 (it runs on vectors).
int xlagen_amx_tiles();
// The same three products for many rows (prompts, encoders: gemm.cc), the weights widened to float32 once
// per block and reused by every row of x: y[m, n] = x[m, k] @ W, W float32 row-major, packed bfloat16, or
// packed int8 (y = x @ (Q * s)).
const char* xlagen_f32_many_product(const float* x, const float* w, float* y, int m, int k, int n);
// The float32 one with the epilogue of the products above (bias and residual may be null; activation 0, 1 or 2).
const char* xlagen_f32_many_product_epilogue(const float* x, const float* w, const float* bias, int activation,
                                             const float* residual, float* y, int m, int k, int n);
const char* xlagen_bf16_many_product(const float* x, const uint32_t* w, float* y, int m, int k, int n);
const char* xlagen_int8_many_product(const float* x, const int8_t* w, float* y, int m, int k, int n);
// out[heads, t, d] = softmax(scale * q k^T) v per head, no mask; k is [heads, s, d], or [heads, d, s] when
// `transposed`; d one of 16, 32, 64, 128.
const char* xlagen_attention(const float* q, const float* k, const float* v, float* out, int heads, int t, int s,
                             int d, float scale, int transposed);
// The same with a mask (a prompt's self-attention): mask[h / heads_per_mask][i % mask_rows][j] nonzero where
// query row i of head h may see key j; masked keys weigh 0, a row that sees no key is the mean of v.
const char* xlagen_masked_attention(const float* q, const float* k, const float* v, const uint8_t* mask, float* out,
                                    int heads, int t, int s, int d, float scale, int heads_per_mask, int mask_rows);
// The same with bias[h % bias_heads][i][j] added to the scaled scores before the mask (T5's relative positions).
const char* xlagen_biased_attention(const float* q, const float* k, const float* v, const uint8_t* mask,
                                    const float* bias, float* out, int heads, int t, int s, int d, float scale,
                                    int heads_per_mask, int mask_rows, int bias_heads);
// Any of the three, each of q, k, v and out read or written where `layout` says (16 ints, 4 per operand in that
// order: offset, batch, head and row strides, in floats): row r of head h = sequence * heads_per_sequence + i
// starts at offset + sequence * batch + i * head + r * row. E.g. the heads of a fused projection [B, T, 3 H d]
// read in place (q: offset 0, batch T * 3 H d, head d, row 3 H d) and the output written as [B, T, H d]. mask
// and bias may be null; heads_per_sequence is also the mask's heads_per_mask.
const char* xlagen_attention_at(const float* q, const float* k, const float* v, const uint8_t* mask,
                                const float* bias, float* out, int heads, int t, int s, int d, float scale,
                                int heads_per_sequence, int mask_rows, int bias_heads, const int* layout);
// xlagen_attention_at with, if `relative`, a bias that depends only on key - row: bias[h % bias_heads][j - i + t -
// 1], t + s - 1 floats per head (T5's relative positions without their dense [t, s] matrix); it needs a mask.
const char* xlagen_relative_attention_at(const float* q, const float* k, const float* v, const uint8_t* mask,
                                         const float* bias, int relative, float* out, int heads, int t, int s, int d,
                                         float scale, int heads_per_sequence, int mask_rows, int bias_heads,
                                         const int* layout);
// A decoding step's self-attention (see attention.cc): q, new_k, new_v, out [groups, heads, queries, d]; the
// cache k, v [groups, heads, s, d]; bias [groups, bias_heads, queries, s + 1] added to the scaled scores,
// -inf marking a key a query may not see (its score is then `mask_value`).
const char* xlagen_step_attention(const float* q, const float* k, const float* v, const float* new_k,
                                  const float* new_v, const float* bias, float* out, int groups, int heads,
                                  int queries, int s, int d, int bias_heads, float scale, float mask_value);
// The folded cross-attention over an encoder output (see attention.cc): q [groups, queries, heads, d],
// m [groups, l, e], wkt [heads * d, e], wkv [e, 2 * heads * d], bkv [2 * heads * d] -> out
// [groups, queries, heads * d]; e a multiple of 64, d one of 16, 32, 64, 128.
const char* xlagen_memory_attention(const float* q, const float* m, const float* wkt, const float* wkv,
                                    const float* bkv, float* out, int groups, int queries, int heads, int d, int l,
                                    int e, float scale);
// out[r] = the index of the largest of x[r, 0..n), the first on ties; NaN is skipped (a row of only -inf
// or NaN gives 0).
const char* xlagen_argmax(const float* x, int32_t* out, int rows, int n);
// The `heads` heads of d columns from column `offset` of in [b, l, width] (heads.cc): out [b, heads, d, length]
// if `transposed`, else [b, heads, length, d], the l positions at [start, start + l) and zeros around them
// (start clamped to [0, length - l]): a decoder's cross-attention keys and values laid out once (length l),
// or a prompt's keys and values written into a fresh cache.
const char* xlagen_split_heads(const float* in, float* out, int b, int l, int width, int offset, int heads, int d,
                               int transposed, int length, int start);
// y = LayerNorm(x) over each of `rows` rows of e values (norm.cc): (x - mean) / sqrt(var + epsilon) * gamma +
// beta, gamma and beta [e] or null (1 and 0).
const char* xlagen_layer_norm(const float* x, const float* gamma, const float* beta, float* y, int rows, int e,
                              float epsilon);
// y = RMSNorm(x) over each row: x / sqrt(mean(x^2) + epsilon) * scale, scale [e] or null (1).
const char* xlagen_rms_norm(const float* x, const float* scale, float* y, int rows, int e, float epsilon);
// out[i, h] = table[h, clamp(ids[i], 0, v - 1)] for a table [e, v], n ids (lookup.cc): a prompt's token
// embeddings from a table stored as the tied output projection.
const char* xlagen_lookup_columns(const float* table, const int32_t* ids, float* out, int e, int v, int n);

// The value of a constant of kernels.h by name (e.g. "panel"), and whether it exists.
int xlagen_constant(const char* name, long* value);

}  // extern "C"

#endif  // XLAGEN_NATIVE_KERNELS_H_
