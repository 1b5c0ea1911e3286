#pragma once
// The serving engine: one compute thread that many callers share (continuous batching), a KV
// pool sized once, and a cache of cartridges under a byte budget.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cartridges/cartridge_cache.h"
#include "cartridges/composition.h"
#include "cartridges/errors.h"
#include "cartridges/model.h"
#include "cartridges/sampling.h"

namespace cartridges {

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
  // Decode steps on CUDA replay a CUDA graph per shape bucket (docs/design.md, "Decode steps
  // as CUDA graphs"): a small model's GPU step is bound by the host's kernel launches, which a
  // graph replays without. No effect on CPU or in a build without CUDA. Default true.
  bool cuda_graphs = true;
  // Decode steps take that fixed-shape path on any device, eagerly when there are no graphs:
  // tests check its arithmetic this way; slower than the default path on CPU. Default false.
  bool fixed_shape_decode = false;
};

struct Request {
  std::vector<int64_t> prompt;  // token ids, not empty
  PrefixList prefixes;          // cartridges in front of the prompt
  SamplingParams params;
  Priority priority = Priority::kInteractive;
  Composition composition = Composition::kMixture;  // with two or more prefixes (the API's default too)
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

// The OS name of an engine's compute thread and of the OpenMP threads it starts (Linux).
inline constexpr char kComputeThreadName[] = "cartridges-step";

struct EngineStats {
  int64_t running = 0, waiting = 0;
  int64_t kv_tokens_used = 0, kv_tokens_total = 0, kv_bytes = 0;
  int64_t kv_compactions = 0;  // times the running requests' KV ranges were packed (fragmentation)
  // Steps that took the fixed-shape decode path, and the CUDA graphs it captured.
  int64_t fixed_shape_steps = 0, cuda_graph_captures = 0;
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
  // A file descriptor that turns readable when a step publishes events (and at shutdown), for
  // an event loop that polls the engine itself instead of a thread that waits in poll(): read
  // it (8 bytes) before poll(0). Made on first call, closed with the engine; -1 where the
  // platform has no eventfd.
  int events_fd();
  // True once shut down and every event has been taken by poll().
  bool drained() const;
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

}  // namespace cartridges
