// xlagen's single-threaded stand-ins for the few compiled Abseil functions the AOT program uses.
//
// The tensorflow pip package ships Abseil's headers (one exact LTS release) but its compiled code
// only inside libtensorflow_framework.so. A program built with tfcompile's default
// (--multithreading=False) runs on one thread, so a spin lock, an atomic counter and plain stderr
// messages are enough here. The definitions match the declarations of the Abseil release in the
// tensorflow package; build with `make ABSL=tensorflow` to take Abseil from libtensorflow_framework
// instead.
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "absl/base/config.h"
#include "absl/base/internal/raw_logging.h"
#include "absl/log/internal/check_op.h"
#include "absl/log/internal/log_message.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"

static_assert(ABSL_LTS_RELEASE_VERSION == 20250814,
              "absl_shim.cc was written against Abseil LTS 20250814 (tensorflow 2.21); build with "
              "`make ABSL=tensorflow` for another tensorflow release");

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::lock() {
  intptr_t unlocked = 0;
  while (!mu_.compare_exchange_weak(unlocked, 1, std::memory_order_acquire)) {
    unlocked = 0;
    std::this_thread::yield();
  }
}

void Mutex::unlock() { mu_.store(0, std::memory_order_release); }

#if !defined(NDEBUG)  // release builds get an empty inline one from mutex.h
void Mutex::Dtor() {}
#endif

BlockingCounter::BlockingCounter(int initial_count)
    : count_(initial_count), num_waiting_(0), done_(initial_count == 0) {}

bool BlockingCounter::DecrementCount() {
  return count_.fetch_sub(1, std::memory_order_acq_rel) == 1;
}

void BlockingCounter::Wait() {
  while (count_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
}

namespace raw_log_internal {

void RawLog(absl::LogSeverity severity, const char* file, int line, const char* format, ...) {
  std::fprintf(stderr, "%s:%d: ", file, line);
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
  if (severity == absl::LogSeverity::kFatal) std::abort();
}

}  // namespace raw_log_internal

namespace log_internal {

// Only failed CHECKs reach these: print the failed condition, then abort.
struct LogMessage::LogMessageData {};

LogMessage::LogMessage(const char* file, int line, absl::LogSeverity) : data_(new LogMessageData) {}

LogMessage::~LogMessage() {}

void LogMessage::Flush() {}

LogMessageFatal::LogMessageFatal(const char* file, int line, const char* failure_msg)
    : LogMessage(file, line, absl::LogSeverity::kFatal) {
  std::fprintf(stderr, "%s:%d: Check failed: %s\n", file, line, failure_msg);
}

LogMessageFatal::~LogMessageFatal() { std::abort(); }

CheckOpMessageBuilder::CheckOpMessageBuilder(const char* exprtext) { stream_ << exprtext << " ("; }

std::ostream& CheckOpMessageBuilder::ForVar2() {
  stream_ << " vs. ";
  return stream_;
}

const char* CheckOpMessageBuilder::NewString() {
  stream_ << ")";
  const std::string text = stream_.str();
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  std::memcpy(copy, text.c_str(), text.size() + 1);
  return copy;
}

template const char* MakeCheckOpString(long, long, const char*);

}  // namespace log_internal

ABSL_NAMESPACE_END
}  // namespace absl
