// Heads laid out from a fused projection [B, L, width], once per generation:
//
// - A decoder's cross-attention memory, before the decoding loop: from the encoder output's key/value
//   projection, keys transposed [B, H, D, L] (a step's scores then read each key dimension's row of L) and
//   values [B, H, L, D]. XLA wrote each through a transposing fusion into a layout of its own and copied it
//   again into the loop's and the first step's (T5-small's 6 layers at 512 positions: about 9 ms of a 52 ms
//   first token with int8 weights); here each is written once, in place.
// - A prompt's keys and values written into a fresh cache [B, H, S, D] of zeros: XLA's write is one fusion
//   per tensor that pads and transposes on one thread (GPT-2-small's 24 of them from a 512-token prompt:
//   about 7 ms). Here the pool writes each head's rows and the zeros around them.

#include <algorithm>

#include "kernels.h"
#include "pool.h"

namespace xlagen {
namespace {

constexpr int kHeadsBlock = 16;  // positions per block of a transposed head

struct SplitHeads {
  const float* in;  // [b, l, width]
  float* out;       // [b, heads, d, length] (transposed) or [b, heads, length, d]
  int b, l, width, offset, heads, d, transposed;
  int length, start;  // the input's l positions are the output's [start, start + l), the others zeros
};

void RunSplitHeads(const void* args, int u0, int u1) {
  const SplitHeads& a = *static_cast<const SplitHeads*>(args);
  const int end = a.start + a.l;
  for (int u = u0; u < u1; ++u) {  // u = sequence * heads + head
    const int sequence = u / a.heads, head = u % a.heads;
    const float* in = a.in + static_cast<size_t>(sequence) * a.l * a.width + a.offset + static_cast<size_t>(head) * a.d;
    float* out = a.out + static_cast<size_t>(u) * a.length * a.d;
    if (!a.transposed) {
      std::fill(out, out + static_cast<size_t>(a.start) * a.d, 0.0f);
      for (int j = 0; j < a.l; ++j) {
        std::copy(in + static_cast<size_t>(j) * a.width, in + static_cast<size_t>(j) * a.width + a.d,
                  out + static_cast<size_t>(a.start + j) * a.d);
      }
      std::fill(out + static_cast<size_t>(end) * a.d, out + static_cast<size_t>(a.length) * a.d, 0.0f);
      continue;
    }
    // out[c][start + j] = in[j][c], in blocks of kHeadsBlock positions: each block's rows of `in` are read once.
    for (int c = 0; c < a.d; ++c) {
      float* to = out + static_cast<size_t>(c) * a.length;
      std::fill(to, to + a.start, 0.0f);
      std::fill(to + end, to + a.length, 0.0f);
    }
    for (int j0 = 0; j0 < a.l; j0 += kHeadsBlock) {
      const int j1 = std::min(a.l, j0 + kHeadsBlock);
      for (int c = 0; c < a.d; ++c) {
        float* to = out + static_cast<size_t>(c) * a.length + a.start;
        for (int j = j0; j < j1; ++j) to[j] = in[static_cast<size_t>(j) * a.width + c];
      }
    }
  }
}

}  // namespace
}  // namespace xlagen

using namespace xlagen;

extern "C" const char* xlagen_split_heads(const float* in, float* out, int b, int l, int width, int offset, int heads,
                                          int d, int transposed, int length, int start) {
  if (b < 0 || l < 0 || heads < 1 || d < 1 || offset < 0 || offset + heads * d > width) {
    return "xlagen_split_heads: b and l must be at least 0, heads and d at least 1, and the heads within width";
  }
  if (length < l) return "xlagen_split_heads: the output's length must be at least l";
  // Where the positions go, clamped as XLA's dynamic-update-slice clamps its start: they all fit.
  start = std::max(0, std::min(start, length - l));
  SplitHeads a{in, out, b, l, width, offset, heads, d, transposed != 0, length, start};
  GetPool().Run(Task{&a, RunSplitHeads, b * heads});
  return nullptr;
}
