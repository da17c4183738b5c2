// xlagen's bfloat16-weight matrix product for XLA's CPU backend: y[M, N] = x[M, K] @ W[K, N], with x and y
// float32 and W stored as bfloat16 in a packed panel layout. Registered as the XLA custom-call target
// "xlagen_bf16_matmul" (status-returning API) by xlagen_register; xlagen/native/__init__.py builds it with
// g++, registers it and emits the call.
//
// Why: a decoding step reads every weight once, so its time is the time to stream the weights from
// memory. XLA's own dot upcasts bfloat16 weights to a float32 copy before multiplying, which reads more
// than float32 weights do; this kernel widens each 64-byte load in registers (a bfloat16 is the top half
// of a float32) and multiplies in float32, so it reads half the bytes of float32 weights and computes
// exactly x @ float32(W).
//
// Layout: panels of 32 output columns, panel p holding rows 0..K-1 of columns 32p..32p+31 contiguously:
// words[p][k][j] (uint32) = bf16(W[k, 32p + j]) | bf16(W[k, 32p + 16 + j]) << 16, j in 0..15.
// Columns past N are zero. One 64-byte load gives 16 words: shifting left by 16 yields the float32 values
// of columns 32p..32p+15, masking the low half yields those of columns 32p+16..32p+31.
//
// The backend config (the custom call's opaque string) is "M,K,N". Work is split by panels between the
// calling thread and the pool's workers (XLAGEN_NATIVE_THREADS, default: the CPUs this process may use,
// at most 8).

#include <dlfcn.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

struct XlaCustomCallStatus_;

namespace {

constexpr int kPanel = 32;  // output columns per panel
constexpr int kRows = 8;    // rows of x per pass over a panel (2 * kRows accumulators stay in registers)
constexpr int kMaxDefaultThreads = 8;
constexpr int kDefaultSpinMicroseconds = 600;

struct Product {
  const float* x;
  const uint32_t* w;
  float* y;
  int m, k, n, panels;
};

void RunPanels(const Product& a, int p0, int p1) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // Panels outside, blocks of rows inside: a panel (K * 64 bytes) comes from memory once and stays in the
  // core's cache for the other blocks, so the weights are streamed once whatever the number of rows.
  for (int p = p0; p < p1; ++p) {
    const uint32_t* w = a.w + static_cast<size_t>(p) * a.k * 16;
    const int c0 = p * kPanel;
    const int nl = a.n - c0 < 16 ? a.n - c0 : 16;
    int nh = a.n - c0 - 16;
    nh = nh < 0 ? 0 : (nh > 16 ? 16 : nh);
    for (int m0 = 0; m0 < a.m; m0 += kRows) {
      const int rows = a.m - m0 < kRows ? a.m - m0 : kRows;
      const float* x = a.x + static_cast<size_t>(m0) * a.k;
      __m512 lo[kRows], hi[kRows];
      for (int i = 0; i < kRows; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
      for (int kk = 0; kk < a.k; ++kk) {
        const __m512i words = _mm512_loadu_si512(w + static_cast<size_t>(kk) * 16);
        const __m512 wl = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
        const __m512 wh = _mm512_castsi512_ps(_mm512_and_si512(words, high));
        for (int i = 0; i < rows; ++i) {
          const __m512 xv = _mm512_set1_ps(x[static_cast<size_t>(i) * a.k + kk]);
          lo[i] = _mm512_fmadd_ps(xv, wl, lo[i]);
          hi[i] = _mm512_fmadd_ps(xv, wh, hi[i]);
        }
      }
      for (int i = 0; i < rows; ++i) {
        float* y = a.y + static_cast<size_t>(m0 + i) * a.n + c0;
        _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << nl) - 1), lo[i]);
        if (nh) _mm512_mask_storeu_ps(y + 16, static_cast<__mmask16>((1u << nh) - 1), hi[i]);
      }
    }
  }
}

// A fixed pool of workers that help the calling thread with one product at a time. The panels are
// handed out in chunks from a shared counter, so nobody waits for a worker that the OS has not scheduled
// (XLA's own threads may hold the cores): the caller takes every chunk left and then waits only for
// chunks already taken. Idle workers spin for a while (a decoding step issues its products tens of
// microseconds apart), then sleep on a futex.
class Pool {
 public:
  Pool(int threads, std::chrono::microseconds spin) : threads_(threads), spin_(spin) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { Loop(); });
  }

  void Run(const Product& a) {
    // XLA may run independent custom calls concurrently: a call that finds the pool busy computes alone.
    if (threads_ == 1 || busy_.test_and_set(std::memory_order_acquire)) {
      RunPanels(a, 0, a.panels);
      return;
    }
    const int chunks = 4 * threads_;
    chunk_ = (a.panels + chunks - 1) / chunks;
    next_.store(0, std::memory_order_relaxed);
    task_ = &a;
    open_.store(true, std::memory_order_seq_cst);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
              nullptr, 0);
    }
    Work(a);
    // Dekker-style handshake with Loop: after this store, a worker that has not joined yet sees the task
    // closed and leaves it alone; one that joined before is counted in active_ and is waited for.
    open_.store(false, std::memory_order_seq_cst);
    while (active_.load(std::memory_order_seq_cst) != 0) _mm_pause();
    busy_.clear(std::memory_order_release);
  }

 private:
  void Work(const Product& a) {
    for (;;) {
      const int p0 = next_.fetch_add(chunk_, std::memory_order_relaxed);
      if (p0 >= a.panels) return;
      RunPanels(a, p0, p0 + chunk_ < a.panels ? p0 + chunk_ : a.panels);
    }
  }

  void Loop() {
    uint32_t seen = 0;  // the generation at construction: a worker that starts late still sees the first task
    for (;;) {
      int spins = 0;
      auto spin_until = std::chrono::steady_clock::now() + spin_;
      uint32_t now;
      while ((now = generation_.load(std::memory_order_acquire)) == seen) {
        if ((++spins & 63) != 0 || std::chrono::steady_clock::now() < spin_until) {
          _mm_pause();
          continue;
        }
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (generation_.load(std::memory_order_seq_cst) == seen) {
          syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, seen, nullptr,
                  nullptr, 0);
        }
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        spin_until = std::chrono::steady_clock::now() + spin_;
      }
      seen = now;
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (open_.load(std::memory_order_seq_cst)) Work(*task_);  // the task of the newest generation
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const int threads_;
  const std::chrono::microseconds spin_;  // how long an idle worker spins before it sleeps
  std::vector<std::thread> workers_;
  const Product* task_ = nullptr;
  int chunk_ = 1;                          // panels per chunk of the current task
  std::atomic<int> next_{0};               // the next panel to hand out
  std::atomic<bool> open_{false};          // whether workers may still join the current task
  std::atomic<int> active_{0};             // workers inside the current task
  std::atomic<uint32_t> generation_{0};    // bumped per task; workers wait on it (futex)
  std::atomic<int> sleepers_{0};
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
};

Pool& GetPool() {
  static Pool* pool = [] {
    int threads = 0;
    if (const char* env = std::getenv("XLAGEN_NATIVE_THREADS")) threads = std::atoi(env);
    if (threads < 1) {
      // The products are bound by memory bandwidth, which a few cores saturate; more threads would only
      // spin between products.
      cpu_set_t cpus;
      threads = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
      threads = threads > kMaxDefaultThreads ? kMaxDefaultThreads : threads;
    }
    int spin = kDefaultSpinMicroseconds;
    if (const char* env = std::getenv("XLAGEN_NATIVE_SPIN_US")) spin = std::atoi(env);
    // Never destroyed: its workers live as long as the process.
    return new Pool(threads < 1 ? 1 : threads, std::chrono::microseconds(spin < 0 ? 0 : spin));
  }();
  return *pool;
}

}  // namespace

extern "C" void xlagen_bf16_matmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                   XlaCustomCallStatus_* /*status*/) {
  char config[64];
  const size_t length = opaque_len < sizeof(config) - 1 ? opaque_len : sizeof(config) - 1;
  std::memcpy(config, opaque, length);
  config[length] = '\0';
  Product a{static_cast<const float*>(in[0]), static_cast<const uint32_t*>(in[1]), static_cast<float*>(out), 0,
            0, 0, 0};
  if (std::sscanf(config, "%d,%d,%d", &a.m, &a.k, &a.n) != 3) std::abort();  // xlagen always writes M,K,N
  a.panels = (a.n + kPanel - 1) / kPanel;
  GetPool().Run(a);
}

// Registers the target with XLA's registry of custom-call targets (xla::CustomCallTargetRegistry, in
// libtensorflow_cc, which TensorFlow has loaded by the time xlagen calls this). The registry is looked up
// by its exported symbols rather than linked: linking against the 1 GB library takes longer than
// compiling this file. Returns 0 on success, or a negative code saying which lookup failed.
extern "C" int xlagen_register(const char* tensorflow_library) {
  void* library = dlopen(tensorflow_library, RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return -1;
  using Global = void* (*)();
  // A member function called through its symbol: `this` is the first argument (Itanium C++ ABI).
  using Register = void (*)(void*, const std::string&, void*, const std::string&);
  auto global = reinterpret_cast<Global>(dlsym(library, "_ZN3xla24CustomCallTargetRegistry6GlobalEv"));
  auto add = reinterpret_cast<Register>(dlsym(
      library, "_ZN3xla24CustomCallTargetRegistry8RegisterERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEEPvS8_"));
  if (global == nullptr || add == nullptr) return -2;
  add(global(), std::string("xlagen_bf16_matmul"), reinterpret_cast<void*>(&xlagen_bf16_matmul), std::string("Host"));
  return 0;
}
