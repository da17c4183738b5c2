// The kernels' thread pool (see pool.h) and the read-ahead of the float32 product expected next.

#include "pool.h"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

namespace xlagen {

std::atomic<long> g_read_ahead{0};

namespace {

// How often the runnable threads are counted at most (a read of /proc/loadavg takes a few microseconds).
constexpr int64_t kSampleNs = 1'000'000;
// The caller spins for its helpers' chunks for twice as long as its own chunks took, at least this long:
// longer, a helper is more likely preempted than slow.
constexpr int64_t kMinPatienceNs = 5'000;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The runnable threads of the machine, the caller's own included, from /proc/loadavg ("0.50 0.40 0.30 3/456
// 789": the 3), or -1.
int Runnable(int loadavg) {
  char text[128];
  const ssize_t size = pread(loadavg, text, sizeof(text) - 1, 0);
  if (size <= 0) return -1;
  text[size] = '\0';
  const char* slash = std::strchr(text, '/');
  if (slash == nullptr) return -1;
  const char* digits = slash;
  while (digits > text && digits[-1] >= '0' && digits[-1] <= '9') --digits;
  return digits == slash ? -1 : std::atoi(digits);
}

template <typename T>
void FutexWait(std::atomic<T>* word, T expected) {
  static_assert(sizeof(T) == 4, "a futex is 32 bits");
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, static_cast<uint32_t>(expected),
          nullptr, nullptr, 0);
}

template <typename T>
void FutexWake(std::atomic<T>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

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
    : threads_(threads),
      spin_ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(spin).count()),
      cpus_(static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)))),
      loadavg_(spin.count() > 0 ? open("/proc/loadavg", O_RDONLY | O_CLOEXEC) : -1),
      lookahead_(lookahead),
      spin_slots_(cpus_ - 1) {
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
  tasks_.fetch_add(1, std::memory_order_relaxed);
  const int chunks = 4 * threads_;
  chunk_ = (a.units + chunks - 1) / chunks;
  range_.store(static_cast<uint64_t>(a.units), std::memory_order_relaxed);
  task_ = &a;
  open_.store(true, std::memory_order_seq_cst);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) FutexWake(&generation_, INT_MAX);
  const int64_t started = NowNs();
  const int ran = Work(a, true);
  // Dekker-style handshake with Loop: after this store, a worker that has not joined yet sees the task
  // closed and leaves it alone; one that joined before is counted in active_ and is waited for.
  open_.store(false, std::memory_order_seq_cst);
  if (active_.load(std::memory_order_seq_cst) != 0) {
    int64_t patience = ran == 0 ? spin_ns_
                                : std::min(spin_ns_, std::max(2 * (NowNs() - started) / ran, kMinPatienceNs));
    // Where no worker may spin, the helpers are likely preempted, and the caller's own chunks took longer
    // for its own preemptions: no measure of the helpers'.
    if (spin_slots_.load(std::memory_order_relaxed) < 1) patience = std::min(patience, kMinPatienceNs);
    AwaitHelpers(patience);
  }
  busy_.clear(std::memory_order_release);
}

// Spins up to `patience_ns` for the helpers still inside the task, then sleeps until the last one leaves.
void Pool::AwaitHelpers(int64_t patience_ns) {
  const int64_t until = NowNs() + patience_ns;
  for (int spins = 0; active_.load(std::memory_order_seq_cst) != 0;) {
    if (patience_ns > 0 && ((++spins & 63) != 0 || NowNs() < until)) {
      _mm_pause();
      continue;
    }
    // Dekker-style handshake with Leave: either the last helper sees caller_sleeps_ and wakes us, or we see
    // active_ at zero (or the futex finds it changed) and do not sleep.
    caller_sleeps_.store(true, std::memory_order_seq_cst);
    const int active = active_.load(std::memory_order_seq_cst);
    if (active != 0) {
      caller_sleeps_count_.fetch_add(1, std::memory_order_relaxed);
      FutexWait(&active_, active);
    }
  }
  caller_sleeps_.store(false, std::memory_order_relaxed);
}

void Pool::Leave() {
  if (active_.fetch_sub(1, std::memory_order_seq_cst) == 1 && caller_sleeps_.load(std::memory_order_seq_cst)) {
    FutexWake(&active_, 1);
  }
}

// The calling thread takes chunks from the front of the units, the workers from the back (the units
// whose weights they prefetched while idle, see Lookahead), until the two meet. Returns the chunks it ran.
int Pool::Work(const Task& a, bool front) {
  uint64_t range = range_.load(std::memory_order_relaxed);
  for (int ran = 0;; ++ran) {
    uint32_t first, end, u0, u1;
    for (;;) {
      first = static_cast<uint32_t>(range >> 32), end = static_cast<uint32_t>(range);
      if (first >= end) return ran;
      if (front) {
        u0 = first;
        u1 = end - first > static_cast<uint32_t>(chunk_) ? first + chunk_ : end;
      } else {
        u1 = end;
        u0 = end - first > static_cast<uint32_t>(chunk_) ? end - chunk_ : first;
      }
      const uint64_t rest = front ? (static_cast<uint64_t>(u1) << 32) | end : (static_cast<uint64_t>(first) << 32) | u0;
      if (range_.compare_exchange_weak(range, rest, std::memory_order_relaxed)) break;
    }
    a.run(a.args, static_cast<int>(u0), static_cast<int>(u1));
    range = range_.load(std::memory_order_relaxed);
  }
}

// Counts the machine's runnable threads, if no worker did for kSampleNs, and sets how many workers may spin:
// the CPUs that the threads other than the spinning workers leave, as smoothed over the last few counts.
void Pool::Sample(int64_t now_ns) {
  int64_t due = next_sample_ns_.load(std::memory_order_relaxed);
  if (loadavg_ < 0 || now_ns < due ||
      !next_sample_ns_.compare_exchange_strong(due, now_ns + kSampleNs, std::memory_order_relaxed)) {
    return;
  }
  const int runnable = Runnable(loadavg_);
  if (runnable < 0) return;
  // Not this worker, which runs as it counts, nor the workers spinning, whose cores are what is shared out.
  const int others = std::max(0, runnable - 1 - spinners_.load(std::memory_order_relaxed));
  int smoothed = others16_.load(std::memory_order_relaxed);
  smoothed += (16 * others - smoothed) / 4;
  others16_.store(smoothed, std::memory_order_relaxed);
  const int slots = cpus_ - (smoothed + 8) / 16;
  spin_slots_.store(slots, std::memory_order_relaxed);
  samples_.fetch_add(1, std::memory_order_relaxed);
  if (slots < 1) crowded_samples_.fetch_add(1, std::memory_order_relaxed);
}

bool Pool::TakeSpinSlot() {
  if (spin_ns_ == 0) return false;
  if (spinners_.fetch_add(1, std::memory_order_relaxed) < spin_slots_.load(std::memory_order_relaxed)) return true;
  spinners_.fetch_sub(1, std::memory_order_relaxed);
  return false;
}

void Pool::Loop(int index) {
  uint32_t seen = 0;  // the generation at construction: a worker that starts late still sees the first task
  uint32_t job_done = 0;
  for (;;) {
    uint32_t generation = generation_.load(std::memory_order_acquire);
    if (generation == seen) Sample(NowNs());
    if (generation == seen && TakeSpinSlot()) {
      const int64_t started = NowNs(), until = started + spin_ns_;
      for (int spins = 0; (generation = generation_.load(std::memory_order_acquire)) == seen;) {
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
        if ((++spins & 63) == 0 && NowNs() >= until) break;
        _mm_pause();
      }
      spinners_.fetch_sub(1, std::memory_order_relaxed);
      spun_ns_.fetch_add(static_cast<long>(NowNs() - started), std::memory_order_relaxed);
    }
    while (generation == seen) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) == seen) FutexWait(&generation_, seen);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      generation = generation_.load(std::memory_order_acquire);
    }
    seen = generation;
    active_.fetch_add(1, std::memory_order_seq_cst);
    if (open_.load(std::memory_order_seq_cst)) Work(*task_, false);  // the task of the newest generation
    Leave();
  }
}

void Pool::Count(long* out) const {
  out[0] = tasks_.load(std::memory_order_relaxed);
  out[1] = spun_ns_.load(std::memory_order_relaxed);
  out[2] = samples_.load(std::memory_order_relaxed);
  out[3] = crowded_samples_.load(std::memory_order_relaxed);
  out[4] = caller_sleeps_count_.load(std::memory_order_relaxed);
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
