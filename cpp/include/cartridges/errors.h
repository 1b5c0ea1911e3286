#pragma once
// The engine's typed errors; the server maps each to its HTTP answer.

#include <stdexcept>

namespace cartridges {

// Prefixes + prompt + max_new_tokens exceed the model's context: the request can never run.
struct ContextLengthError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// The waiting queue is full: try again later.
struct EngineBusyError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A cartridge larger than what the cache may hold once every idle cartridge is evicted.
struct CacheFullError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The engine has shut down (or its compute thread failed).
struct EngineStoppedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace cartridges
