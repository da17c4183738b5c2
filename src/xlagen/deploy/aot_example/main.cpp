// Runs xlagen's ahead-of-time compiled greedy generate and prints the token ids.
//
// Usage: ./generate [--attention-mask M,M,...] [--repeat N] [ID ...]
//   ID ...            batch_size * prompt_length prompt ids, row after row (read from stdin when
//                     none are given); rows shorter than prompt_length are left-padded by the caller
//                     and masked out with --attention-mask.
//   --attention-mask  batch_size * prompt_length zeros and ones (default: all ones).
//   --repeat N        run the program N times and report the time per run on stderr.
// Prints one line per row: the prompt followed by the new tokens, as `model.generate` returns them.
//
// Nothing here depends on TensorFlow: the program is the object files tfcompile wrote, the few XLA
// runtime sources shipped in the tensorflow pip package, and this file.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "xlagen_aot_config.h"  // written by xlagen: the header to include and the shapes

namespace {

bool ParseInts(const std::string& text, char separator, std::vector<int32_t>* values) {
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, separator)) {
    if (item.empty()) continue;
    char* end = nullptr;
    const long value = std::strtol(item.c_str(), &end, 10);
    if (*end != '\0') return false;
    values->push_back(static_cast<int32_t>(value));
  }
  return true;
}

int Fail(const std::string& message) {
  std::cerr << "generate: " << message << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  constexpr int kInputs = xlagen_aot::kBatchSize * xlagen_aot::kPromptLength;
  std::vector<int32_t> ids, mask;
  int repeat = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--attention-mask" && i + 1 < argc) {
      if (!ParseInts(argv[++i], ',', &mask)) return Fail("--attention-mask wants comma-separated integers");
    } else if (arg == "--repeat" && i + 1 < argc) {
      repeat = std::atoi(argv[++i]);
      if (repeat < 1) return Fail("--repeat wants a positive integer");
    } else if (!ParseInts(arg, ' ', &ids)) {
      return Fail("not a token id: " + arg);
    }
  }
  if (ids.empty()) {
    int32_t value;
    while (std::cin >> value) ids.push_back(value);
  }
  if (static_cast<int>(ids.size()) != kInputs) {
    return Fail("expected " + std::to_string(kInputs) + " prompt ids (batch " +
                std::to_string(xlagen_aot::kBatchSize) + " x prompt length " +
                std::to_string(xlagen_aot::kPromptLength) + "), got " + std::to_string(ids.size()));
  }
  if (mask.empty()) mask.assign(kInputs, 1);
  if (static_cast<int>(mask.size()) != kInputs) {
    return Fail("expected " + std::to_string(kInputs) + " attention mask values, got " +
                std::to_string(mask.size()));
  }

  xlagen_aot::Program program;
  std::memcpy(program.arg_feed_input_ids_data(), ids.data(), kInputs * sizeof(int32_t));
  std::memcpy(program.arg_feed_attention_mask_data(), mask.data(), kInputs * sizeof(int32_t));
  if (!program.Run()) return Fail("run failed: " + program.error_msg());
  if (repeat > 0) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeat; ++i) {
      if (!program.Run()) return Fail("run failed: " + program.error_msg());
    }
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
    const double per_run = seconds.count() / repeat;
    std::fprintf(stderr, "%.3f ms per run, %.1f new tokens/s\n", per_run * 1e3,
                 xlagen_aot::kBatchSize * xlagen_aot::kMaxNewTokens / per_run);
  }

  const int32_t* sequences = program.result_fetch_sequences_data();
  const int row_length = program.result_fetch_sequences_count() / xlagen_aot::kBatchSize;
  for (int row = 0; row < xlagen_aot::kBatchSize; ++row) {
    for (int t = 0; t < row_length; ++t) {
      std::printf(t ? " %d" : "%d", sequences[row * row_length + t]);
    }
    std::printf("\n");
  }
  return 0;
}
