// The kernels' thread pool (see pool.h) and the read-ahead of the float32 product expected next.

#include "pool.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>

namespace xlagen {

std::atomic<long> g_read_ahead{0};

namespace {

// Prefetches the first `budget` bytes that a worker will read of `a` (as PlanF32 split it): the workers take
// units from the back (Pool::Work), worker `offset` of `stride` the units from the last down, one in
// `stride`, each unit's weight rows in the order it reads them. Stops early when `stop` says to. A prefetch
// never faults, so a product whose weights have been freed since is harmless.
template <typename Stop>
void PrefetchF32(const F32Product& a, int offset, int stride, size_t budget, Stop stop) {
  const int units = a.blocks * ((a.k + a.split_rows - 1) / a.split_rows);
  const int width = a.m <= kMaxStreamM ? a.span : kBlock;
  size_t fetched = 0;
  for (int u = units - 1 - offset; u >= 0; u -= stride) {
    const Unit unit = UnitOf(a, u, width);
    const int bytes = 4 * unit.columns;
    for (int k = unit.k_begin; k < unit.k_end; ++k) {
      const char* row = reinterpret_cast<const char*>(a.w + static_cast<size_t>(k) * a.n + unit.c0);
      for (int b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
      _mm_prefetch(row + bytes - 1, _MM_HINT_T0);  // the last line, when the row does not start one
      fetched += bytes;
      if (fetched >= budget || stop()) break;
    }
    if (fetched >= budget || stop()) break;
  }
  g_read_ahead.fetch_add(static_cast<long>(fetched), std::memory_order_relaxed);
}

}  // namespace

Pool::Pool(int threads, std::chrono::microseconds spin, size_t lookahead)
    : threads_(threads), spin_(spin), lookahead_(lookahead) {
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { Loop(i); });
}

void Pool::Lookahead(const F32Product& next) {
  if (threads_ == 1 || lookahead_.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::mutex> lock(job_mutex_);
  job_ = next;
  job_seq_.fetch_add(1, std::memory_order_release);
}

void Pool::Run(const Task& a) {
  // XLA may run independent custom calls concurrently: a call that finds the pool busy computes alone.
  if (threads_ == 1 || busy_.test_and_set(std::memory_order_acquire)) {
    a.run(a.args, 0, a.units);
    return;
  }
  const int chunks = 4 * threads_;
  chunk_ = (a.units + chunks - 1) / chunks;
  range_.store(static_cast<uint64_t>(a.units), std::memory_order_relaxed);
  task_ = &a;
  open_.store(true, std::memory_order_seq_cst);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
            nullptr, 0);
  }
  Work(a, true);
  // Dekker-style handshake with Loop: after this store, a worker that has not joined yet sees the task
  // closed and leaves it alone; one that joined before is counted in active_ and is waited for.
  open_.store(false, std::memory_order_seq_cst);
  while (active_.load(std::memory_order_seq_cst) != 0) _mm_pause();
  busy_.clear(std::memory_order_release);
}

// The calling thread takes chunks from the front of the units, the workers from the back (the units
// whose weights they prefetched while idle, see Lookahead), until the two meet.
void Pool::Work(const Task& a, bool front) {
  uint64_t range = range_.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t first = static_cast<uint32_t>(range >> 32), end = static_cast<uint32_t>(range);
    if (first >= end) return;
    uint32_t u0, u1;
    if (front) {
      u0 = first;
      u1 = end - first > static_cast<uint32_t>(chunk_) ? first + chunk_ : end;
    } else {
      u1 = end;
      u0 = end - first > static_cast<uint32_t>(chunk_) ? end - chunk_ : first;
    }
    const uint64_t rest = front ? (static_cast<uint64_t>(u1) << 32) | end : (static_cast<uint64_t>(first) << 32) | u0;
    if (!range_.compare_exchange_weak(range, rest, std::memory_order_relaxed)) continue;
    a.run(a.args, static_cast<int>(u0), static_cast<int>(u1));
    range = range_.load(std::memory_order_relaxed);
  }
}

void Pool::Loop(int index) {
  uint32_t seen = 0;  // the generation at construction: a worker that starts late still sees the first task
  uint32_t job_done = 0;
  for (;;) {
    int spins = 0;
    auto spin_until = std::chrono::steady_clock::now() + spin_;
    uint32_t now;
    while ((now = generation_.load(std::memory_order_acquire)) == seen) {
      if (job_seq_.load(std::memory_order_acquire) != job_done) {
        F32Product next;
        {
          std::lock_guard<std::mutex> lock(job_mutex_);
          next = job_;
          job_done = job_seq_.load(std::memory_order_relaxed);
        }
        PrefetchF32(next, index - 1, threads_ - 1, lookahead_.load(std::memory_order_relaxed),
                    [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        continue;
      }
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
    if (open_.load(std::memory_order_seq_cst)) Work(*task_, false);  // the task of the newest generation
    active_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

namespace {
// The pool's settings, given by xlagen_configure_pool before the pool is made (negative: the default).
std::atomic<int> g_threads{-1};
std::atomic<int> g_spin_us{-1};
std::atomic<long> g_lookahead_kb{-1};
std::atomic<bool> g_pool_made{false};
}  // namespace

bool ConfigurePool(int threads, int spin_us, long lookahead_kb) {
  if (g_pool_made.load(std::memory_order_acquire)) return false;
  g_threads.store(threads, std::memory_order_relaxed);
  g_spin_us.store(spin_us, std::memory_order_relaxed);
  g_lookahead_kb.store(lookahead_kb, std::memory_order_release);
  return true;
}

Pool& GetPool() {
  static Pool* pool = [] {
    g_pool_made.store(true, std::memory_order_release);
    int threads = g_threads.load(std::memory_order_acquire);
    if (threads < 1) {
      // The products are bound by memory bandwidth, which a few cores saturate; more threads would only
      // spin between products.
      cpu_set_t cpus;
      threads = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
      threads = threads > kMaxDefaultThreads ? kMaxDefaultThreads : threads;
    }
    int spin = g_spin_us.load(std::memory_order_acquire);
    if (spin < 0) spin = kDefaultSpinMicroseconds;
    long lookahead = g_lookahead_kb.load(std::memory_order_acquire);
    if (lookahead < 0) lookahead = kDefaultLookaheadKB;
    // Never destroyed: its workers live as long as the process.
    return new Pool(threads, std::chrono::microseconds(spin), static_cast<size_t>(lookahead) * 1024);
  }();
  return *pool;
}

bool Successors::Follow(const F32Product& current, F32Product* next) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++calls_;
  if (last_ != nullptr) {
    auto found = next_.find(last_);
    if (found != next_.end()) {
      if (found->second.w == current.w) ++predicted_;
      found->second = current;
    } else {
      if (next_.size() >= kMaxProducts) next_.clear();
      next_.emplace(last_, current);
    }
  }
  last_ = current.w;
  const auto found = next_.find(current.w);
  if (found == next_.end()) return false;
  *next = found->second;
  return true;
}

void Successors::Count(long* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  out[0] = calls_;
  out[1] = predicted_;
}

Successors& GetSuccessors() {
  static Successors* successors = new Successors;  // never destroyed, like the pool
  return *successors;
}

}  // namespace xlagen
