#pragma once
// The serving engine: one compute thread that many callers share (continuous batching), a KV
// pool sized once, and a cache of cartridges under a byte budget. Sampling lives here too.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "cartridges/model.h"

namespace cartridges {

// ---- sampling --------------------------------------------------------------------------

struct SamplingParams {
  double temperature = 0.0;  // 0 samples greedily (argmax)
  double top_p = 1.0;        // keep the smallest set of tokens holding this much probability
  int64_t top_k = 0;         // keep only the k most likely tokens; 0 keeps all
  int64_t seed = -1;         // same seed, same output; negative draws a fresh seed
  int64_t max_new_tokens = 256;
  std::vector<int64_t> stop_token_ids;  // generation ends after producing one of these
  // Also return, for every sampled token, its log-probability and the `logprobs` most likely
  // tokens with theirs, under the model's own distribution (temperature 1, no filtering).
  int64_t logprobs = 0;
};

// Draws tokens for one sequence; owns that sequence's random generator.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // logits: [vocab] float32, on any device.
  int64_t sample(const at::Tensor& logits);

 private:
  SamplingParams params_;
  at::Generator generator_;
};

// Logits with everything outside the k most likely tokens set to -inf.
at::Tensor filter_top_k(const at::Tensor& logits, int64_t k);
// Logits with everything outside the smallest most-likely set of mass >= p set to -inf.
at::Tensor filter_top_p(const at::Tensor& logits, double p);

// ---- typed errors (the server maps them to HTTP answers) ----------------------------------

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

// ---- cartridge cache -------------------------------------------------------------------

struct CartridgeCacheStats {
  int64_t entries = 0, bytes = 0, budget_bytes = 0;
  int64_t hits = 0, misses = 0, loads = 0, evictions = 0;
};

// Cartridges (KV prefixes) by id under a byte budget. A cartridge that a queued or running
// request holds (its shared pointer is held outside the cache) is never evicted; loading past
// the budget evicts the least recently used idle ones. Thread-safe.
class CartridgeCache {
 public:
  explicit CartridgeCache(int64_t budget_bytes);

  // The cartridge, marked as just used; null when absent (counted as a miss).
  PrefixPtr get(const std::string& id);
  bool contains(const std::string& id) const;
  // Adds (or replaces) a cartridge, evicting idle ones as needed; CacheFullError when it
  // cannot fit even then (nothing is evicted in that case).
  void put(const std::string& id, PrefixPtr prefix);
  // Removes it from the cache (a request holding it keeps its copy alive until it ends).
  bool remove(const std::string& id);
  std::vector<std::string> ids() const;  // most recently used first
  CartridgeCacheStats stats() const;

 private:
  struct Entry {
    std::string id;
    PrefixPtr prefix;
    int64_t bytes;
  };
  mutable std::mutex mutex_;
  int64_t budget_, bytes_ = 0;
  CartridgeCacheStats counters_;
  std::list<Entry> lru_;  // front: most recently used
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
};

// ---- engine ----------------------------------------------------------------------------

enum class Priority { kInteractive = 0, kBackground = 1 };

struct EngineOptions {
  // KV pool size in tokens, allocated once and shared by the own tokens (prompt + output) of
  // every running request; a request reserves prompt + max_new_tokens slots when it starts.
  // Cartridges are not in the pool. Default 32768 (1.4 GiB for SmolLM2-135M in float32).
  int64_t kv_tokens = 32768;
  // Requests decoded together in one step at most. Default 64.
  int64_t max_running = 64;
  // Prompt tokens prefilled per step at most, beside one decode token per running request:
  // bounds how long a step (and so every running request's next token) can take. Default 512.
  int64_t prefill_tokens_per_step = 512;
  // Requests waiting for room at most; beyond it submit raises EngineBusyError. Default 1024.
  int64_t max_waiting = 1024;
  // Bytes of cartridges kept loaded in the engine's cartridge cache. Default 1 GiB.
  int64_t cartridge_cache_bytes = int64_t{1} << 30;
  // Intra-op threads of the compute thread; 0 takes the creating thread's ATen setting
  // (torch.set_num_threads). Default 0.
  int num_threads = 0;
};

// How several cartridges of one request are composed.
enum class Composition {
  // Their KV one after another in front of one sequence, in order: attention decides which
  // to read. Cartridges trained alone pull every question to themselves, so each document's
  // questions lose most of their gain (docs/experiments.md, "Why does composition by
  // concatenation fail, and can training fix it?").
  kConcatenate = 0,
  // One sequence per cartridge (same prompt, own KV range); each step samples from the
  // mixture of their next-token distributions, each weighted by the likelihood it gave to
  // everything before from `Request::weigh_from` on (prompt and output so far; a uniform
  // prior): the cartridge that explains the conversation best speaks. Costs one sequence per
  // cartridge (a cartridge given twice, the same object, is composed once).
  kMixture = 1,
};

struct Request {
  std::vector<int64_t> prompt;  // token ids, not empty
  PrefixList prefixes;          // cartridges in front of the prompt
  SamplingParams params;
  Priority priority = Priority::kInteractive;
  Composition composition = Composition::kConcatenate;  // with two or more prefixes
  // A mixture's weights count the prompt from this token on, and all the output. Text that
  // every cartridge is shown alike (the chat template's opening, a system prompt) tells no
  // document from another, yet a strongly trained cartridge explains it better and would
  // take every question (docs/experiments.md, "Which tokens should a mixture's weights count?"):
  // callers start at the conversation's first message after the system prompt.
  int64_t weigh_from = 0;
};

struct Event {
  enum class Kind { kToken, kFinished };
  int64_t request = 0;
  Kind kind = Kind::kToken;
  // kToken: the sampled token, and its log-probabilities when asked for (under the
  // distribution it was sampled from: the mixture's, for a mixture).
  int64_t token = -1;
  float logprob = 0.f;
  std::vector<int64_t> top_ids;
  std::vector<float> top_logprobs;
  // kFinished: "stop", "length", "cancelled" or "error" (then `error` says why).
  std::string finish_reason;
  std::string error;
};

struct EngineStats {
  int64_t running = 0, waiting = 0;
  int64_t kv_tokens_used = 0, kv_tokens_total = 0, kv_bytes = 0;
  int64_t steps = 0, prompt_tokens = 0, generated_tokens = 0;
  int64_t finished = 0, cancelled = 0;
  CartridgeCacheStats cartridges;
};

class EngineImpl;

// Owns the model's compute on one thread. submit/cancel/poll/stats are thread-safe.
class Engine {
 public:
  Engine(std::shared_ptr<const LlamaModel> model, EngineOptions options = {});
  ~Engine();  // shuts down
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request and returns its id. ContextLengthError when it can never fit the context
  // or the pool; EngineBusyError when the waiting queue is full; c10::Error for bad params.
  int64_t submit(Request request);
  // Queues several requests at once (they start in the same step when there is room, which
  // makes a seeded batch repeatable); all or none are queued.
  std::vector<int64_t> submit_all(std::vector<Request> requests);
  // Ends a queued or running request with finish_reason "cancelled"; false if unknown/ended.
  bool cancel(int64_t id);
  // Events of finished steps, in order; waits up to `timeout` for the first one. Empty after
  // shutdown once everything has been delivered.
  std::vector<Event> poll(std::chrono::milliseconds timeout);
  EngineStats stats() const;
  // Intra-op threads of the compute thread from its next step on (at least 1): a server
  // gives cores to training jobs while they run and takes them back after.
  void set_num_threads(int threads);
  int num_threads() const;
  CartridgeCache& cartridges();
  const EngineOptions& options() const;
  const LlamaModel& model() const;
  // Cancels everything, stops the compute thread; idempotent.
  void shutdown();
  bool running() const;

 private:
  std::unique_ptr<EngineImpl> impl_;
};

// Convenience for one closed batch (tests, scripts): submits every request to `engine`,
// waits for all, returns (tokens, finish_reason) per request in order.
struct GenerationResult {
  std::vector<int64_t> tokens;  // generated tokens, the stop token included
  std::string finish_reason;
};
std::vector<GenerationResult> generate_all(Engine& engine, const std::vector<Request>& requests);

}  // namespace cartridges
