// A prompt's token embeddings from a table stored [E, V] (xlagen.layers.embeddings.TokenEmbedding keeps the
// tied output projection's layout): out[i, h] = table[h, ids[i]]. Each value is in its own cache line of its
// row; XLA's gather fetches them one output element at a time (about 3 ms for GPT-2-small's 512 tokens x
// 768); here a unit takes 16 rows of the table and, token by token, gathers one value from each and stores
// them as 16 consecutive floats of the token's output row, with the memory's fetches of the 16 rows in
// flight together. Ids outside [0, V) are clamped into it, as XLA's gather clamps its indices.

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "pool.h"

namespace xlagen {
namespace {

constexpr int kLookupRows = 16;  // rows of the table per unit

struct Lookup {
  const float* table;  // [e, v]
  const int32_t* ids;  // [n]
  float* out;          // [n, e]
  int e, v, n;
};

void RunLookup(const void* args, int u0, int u1) {
  const Lookup& a = *static_cast<const Lookup*>(args);
  for (int u = u0; u < u1; ++u) {
    const int h0 = u * kLookupRows, rows = std::min(kLookupRows, a.e - h0);
    const float* table = a.table + static_cast<size_t>(h0) * a.v;
    for (int i = 0; i < a.n; ++i) {
      const size_t id = static_cast<size_t>(std::clamp(a.ids[i], 0, a.v - 1));
      float* out = a.out + static_cast<size_t>(i) * a.e + h0;
      for (int r = 0; r < rows; ++r) out[r] = table[static_cast<size_t>(r) * a.v + id];
    }
  }
}

}  // namespace
}  // namespace xlagen

using namespace xlagen;

extern "C" const char* xlagen_lookup_columns(const float* table, const int32_t* ids, float* out, int e, int v, int n) {
  if (e < 1 || v < 1 || n < 0) return "xlagen_lookup_columns: e and v must be at least 1, n at least 0";
  Lookup a{table, ids, out, e, v, n};
  GetPool().Run(Task{&a, RunLookup, (e + kLookupRows - 1) / kLookupRows});
  return nullptr;
}
