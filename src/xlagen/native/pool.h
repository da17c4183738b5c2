// The kernels' thread pool, and the read-ahead of the float32 product expected next (pool.cc).

#ifndef XLAGEN_NATIVE_POOL_H_
#define XLAGEN_NATIVE_POOL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "f32_product.h"

namespace xlagen {

// One product for the pool: `units` independent pieces of work, run(args, u0, u1) does units [u0, u1).
struct Task {
  const void* args;
  void (*run)(const void* args, int u0, int u1);
  int units;
};

// A fixed pool of workers that help the calling thread with one product at a time. The units are handed
// out in chunks from a shared range, so nobody waits for a worker that the OS has not scheduled (XLA's own
// threads may hold the cores): the caller takes every chunk left and then waits only for chunks already
// taken. Idle workers spin for a while (a decoding step issues its products tens of microseconds apart),
// reading ahead the weights of the float32 product expected next (Lookahead), then sleep on a futex.
class Pool {
 public:
  Pool(int threads, std::chrono::microseconds spin, size_t lookahead);

  int threads() const { return threads_; }
  size_t lookahead() const { return threads_ == 1 ? 0 : lookahead_.load(std::memory_order_relaxed); }
  void set_lookahead(size_t bytes) { lookahead_.store(bytes, std::memory_order_relaxed); }

  // Hands the idle workers the product expected next (as PlanF32 split it), whose weights they prefetch
  // until a task comes.
  void Lookahead(const F32Product& next);

  void Run(const Task& a);

 private:
  void Work(const Task& a, bool front);
  void Loop(int index);

  const int threads_;
  const std::chrono::microseconds spin_;  // how long an idle worker spins before it sleeps
  std::atomic<size_t> lookahead_;          // bytes of the next product each idle worker prefetches
  std::mutex job_mutex_;
  F32Product job_{};                       // the product expected next
  std::atomic<uint32_t> job_seq_{0};       // bumped per expected product
  std::vector<std::thread> workers_;
  const Task* task_ = nullptr;
  int chunk_ = 1;                          // units per chunk of the current task
  std::atomic<uint64_t> range_{0};         // units not handed out yet: [high 32 bits, low 32 bits)
  std::atomic<bool> open_{false};          // whether workers may still join the current task
  std::atomic<int> active_{0};             // workers inside the current task
  std::atomic<uint32_t> generation_{0};    // bumped per task; workers wait on it (futex)
  std::atomic<int> sleepers_{0};
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
};

// The process's pool, made at the first kernel call with the settings of ConfigurePool (else the defaults).
Pool& GetPool();

// Sets the pool's threads (caller included), the microseconds an idle worker spins before it sleeps, and
// the KiB each idle worker reads ahead; a negative value (threads: below 1) keeps the default. Returns false,
// changing nothing, once the pool is made.
bool ConfigurePool(int threads, int spin_us, long lookahead_kb);

// The product that comes next, as far as the last calls tell. A decoding step calls the same products in the
// same order at every step (the weights of a compiled loop keep their buffers), and between two products XLA
// runs the step's other operations (norms, attention, ...) on the calling thread, while the memory is idle
// and the pool's workers spin. An idle worker reads ahead the start of the next product's share of the
// weights that it will take (Pool::Lookahead); a wrong guess costs only the bytes read for nothing.
class Successors {
 public:
  // Records that `current` came after the previous product; returns in *next the product that came after
  // `current` last time (false when none did).
  bool Follow(const F32Product& current, F32Product* next);

  // [calls, calls that were the product predicted after the previous one]
  void Count(long* out);

 private:
  static constexpr size_t kMaxProducts = 4096;  // weights remembered (a program's products, and then some)
  std::mutex mutex_;
  const float* last_ = nullptr;
  std::unordered_map<const float*, F32Product> next_;  // weights -> the product that came next
  long calls_ = 0, predicted_ = 0;
};

Successors& GetSuccessors();

extern std::atomic<long> g_read_ahead;  // bytes the workers have read ahead

}  // namespace xlagen

#endif  // XLAGEN_NATIVE_POOL_H_
