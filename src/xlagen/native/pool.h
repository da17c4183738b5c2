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
// taken.
//
// Waiting spins only while spinning pays. An idle worker spins for at most `spin` (a decoding step issues
// its products tens of microseconds apart, and a sleeping worker takes tens of microseconds to wake),
// reading ahead the weights of the float32 product expected next (Lookahead), then sleeps on a futex. But a
// spinning thread holds a core that another runnable thread may want: with more runnable threads than cores
// the spinner only takes time from others, the calling thread of its own pool first (Linux schedules a
// session's threads as one group, so the spinner spends the caller's share), and a caller that spins for a
// helper that the OS preempted mid-chunk burns its own time slice while the helper waits for one. So, as Go's
// scheduler spins only where a processor is idle, the workers spin only on cores that nothing else wants:
// going idle, a worker counts the machine's runnable threads (/proc/loadavg, at most every kSampleNs),
// smooths the count of those that are not spinning workers, and as many workers may spin as there are CPUs
// beyond it; the others sleep at once. The caller spins for its helpers only about as long as its own chunks
// took, and hardly at all when no worker may spin; then it sleeps until the last helper leaves.
class Pool {
 public:
  Pool(int threads, std::chrono::microseconds spin, size_t lookahead);

  int threads() const { return threads_; }
  int spin_us() const { return static_cast<int>(spin_ns_ / 1000); }
  size_t lookahead() const { return threads_ == 1 ? 0 : lookahead_.load(std::memory_order_relaxed); }
  void set_lookahead(size_t bytes) { lookahead_.store(bytes, std::memory_order_relaxed); }

  // Hands the idle workers the product expected next (as PlanF32 split it), whose weights they prefetch
  // until a task comes.
  void Lookahead(const F32Product& next);

  void Run(const Task& a);

  // [tasks run on the pool, nanoseconds the workers spun, samples of the runnable threads, samples that left
  // no core to spin on, times the caller slept waiting for a helper]
  void Count(long* out) const;

 private:
  int Work(const Task& a, bool front);
  void Loop(int index);
  void AwaitHelpers(int64_t patience_ns);
  void Leave();
  void Sample(int64_t now_ns);
  bool TakeSpinSlot();

  const int threads_;
  const int64_t spin_ns_;                  // how long an idle worker spins at most before it sleeps
  const int cpus_;                         // the machine's online CPUs, which /proc/loadavg's count shares
  const int loadavg_;                      // /proc/loadavg, open (-1: unreadable, spin slots stay cpus_ - 1)
  std::atomic<size_t> lookahead_;          // bytes of the next product each idle worker prefetches
  std::mutex job_mutex_;
  F32Product job_{};                       // the product expected next
  std::atomic<uint32_t> job_seq_{0};       // bumped per expected product
  std::vector<std::thread> workers_;
  const Task* task_ = nullptr;
  int chunk_ = 1;                          // units per chunk of the current task
  std::atomic<uint64_t> range_{0};         // units not handed out yet: [high 32 bits, low 32 bits)
  std::atomic<bool> open_{false};          // whether workers may still join the current task
  std::atomic<int> active_{0};             // workers inside the current task; the caller waits on it (futex)
  std::atomic<bool> caller_sleeps_{false}; // whether the caller sleeps on active_ (the last to leave wakes it)
  std::atomic<uint32_t> generation_{0};    // bumped per task; workers wait on it (futex)
  std::atomic<int> sleepers_{0};
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
  std::atomic<int64_t> next_sample_ns_{0};  // no worker samples /proc/loadavg before this steady-clock time
  std::atomic<int> others16_{16};           // runnable threads but the spinning workers, smoothed, in 1/16
  std::atomic<int> spin_slots_;             // how many workers may spin at once (none when below 1)
  std::atomic<int> spinners_{0};            // workers spinning now
  // Count()'s counters.
  std::atomic<long> tasks_{0}, spun_ns_{0}, samples_{0}, crowded_samples_{0}, caller_sleeps_count_{0};
};

// The process's pool, made at the first kernel call with the settings of ConfigurePool (else the defaults).
Pool& GetPool();

// Sets the pool's threads (caller included), the microseconds an idle worker spins at most before it sleeps
// (0: no thread of the pool ever spins), and the KiB each idle worker reads ahead; a negative value (threads:
// below 1) keeps the default. Returns false, changing nothing, once the pool is made.
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
