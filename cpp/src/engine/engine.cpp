// The engine's compute thread: each step takes cancels, admits waiting requests, runs one
// packed forward (a decode token for every running request plus prompt chunks), samples and
// hands the events to whoever polls. Longer than 400 lines: a request's life (checks, admission,
// prefill, decode, mixture weights, cancellation, events) is the state of this one thread; the
// policy is in scheduler, KV ranges in kv_range_allocator, the rules of context in composition.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <condition_variable>
#include <cstdio>
#include <set>
#include <thread>

#include <unistd.h>
#ifdef __linux__
#include <pthread.h>
#include <sys/eventfd.h>
#endif

#include "cartridges/compute.h"
#include "cartridges/kv_pool.h"
#include "cartridges/engine.h"
#include "engine/fixed_decode.h"
#include "engine/scheduler.h"
#include "engine/step_threads.h"
#include "model/spin_pool.h"

namespace cartridges {

namespace {

// A request of one sequence per cartridge while its prompt is read (a mixture, or a route).
bool is_mixture(const Request& request) {
  return request.composition != Composition::kConcatenate && request.prefixes.size() >= 2;
}

// Positions the request's cartridges take in front of its prompt (tokens_in_front).
int64_t prefix_tokens(const Request& request) {
  std::vector<int64_t> lengths;
  for (const auto& p : request.prefixes) lengths.push_back(p->num_tokens());
  return tokens_in_front(lengths, request.composition);
}

bool is_stop(const SamplingParams& params, int64_t token) {
  return std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) != params.stop_token_ids.end();
}

// The first position of a prompt chunk (`chunk` tokens after `start`) whose logits weigh a
// mixture's cartridges: position j predicts prompt token start + j + 1, tokens before
// weigh_from add nothing, and the prompt's last position, which predicts the output, always
// has its row. The earlier positions get none: the chat template's opening and the system
// prompt skip the output layer, the largest matrix product of a token.
int64_t first_weighed(const Request& request, int64_t start, int64_t chunk) {
  const bool ends_prompt = start + chunk == static_cast<int64_t>(request.prompt.size());
  return std::clamp<int64_t>(request.weigh_from - start - 1, 0, ends_prompt ? chunk - 1 : chunk);
}

// Keeps the first of each cartridge (by identity), in order.
void drop_repeats(PrefixList& prefixes) {
  PrefixList kept;
  for (const auto& p : prefixes) {
    if (std::find(kept.begin(), kept.end(), p) == kept.end()) kept.push_back(p);
  }
  prefixes.swap(kept);
}

}  // namespace

// A request as the compute thread sees it. Only the compute thread touches it after submit.
struct Live {
  int64_t id;
  Request request;
  Sampler sampler;
  std::vector<int64_t> generated;
  // One sequence per cartridge for a mixture, else one. Sequence b owns `slots` pool slots
  // from kv_offset + b * slots; log_weights[b] is the log-likelihood that cartridge b gave to
  // the prompt and output so far (less a common constant).
  int64_t branches = 1;
  int64_t slots = 0;
  std::vector<double> log_weights;
};

class EngineImpl {
 public:
  EngineImpl(std::shared_ptr<const LlamaModel> model, EngineOptions options)
      : model_(std::move(model)),
        options_(options),
        scheduler_({options.kv_tokens, options.max_running, options.prefill_tokens_per_step, options.max_waiting}),
        pool_(model_->config(), options.kv_tokens, model_->options()),
        cartridges_(options.cartridge_cache_bytes),
        // OpenMP's thread count is per thread: a new thread would start from the process
        // default (every core), not from what the caller chose. Take the caller's when unset.
        requested_threads_(options.num_threads > 0 ? options.num_threads : at::get_num_threads()) {
    if (options.cuda_graphs && model_->device().is_cuda() && cuda_graphs_built()) {
      fixed_decode_ = std::make_unique<FixedDecode>(model_, /*graphs=*/true);
    } else if (options.fixed_shape_decode) {
      fixed_decode_ = std::make_unique<FixedDecode>(model_, /*graphs=*/false);
    }
    thread_ = std::thread([this] { run(); });
  }

  ~EngineImpl() {
    shutdown();
    if (events_fd_ >= 0) close(events_fd_);
  }

  std::vector<int64_t> submit_all(std::vector<Request> requests) {
    std::vector<Sampler> samplers;
    for (auto& r : requests) {
      samplers.push_back(check(r));
      if (r.composition != Composition::kConcatenate) drop_repeats(r.prefixes);  // a cartridge twice adds nothing
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw EngineStoppedError("the engine has shut down");
    std::vector<int64_t> ids;
    try {
      for (size_t i = 0; i < requests.size(); ++i) {
        const int64_t id = next_id_;
        const int64_t prompt = static_cast<int64_t>(requests[i].prompt.size());
        const int64_t slots = prompt + requests[i].params.max_new_tokens;
        const int64_t branches = is_mixture(requests[i]) ? static_cast<int64_t>(requests[i].prefixes.size()) : 1;
        scheduler_.enqueue(id, requests[i].priority, prompt, slots * branches, branches);
        ++next_id_;
        ids.push_back(id);
        lives_.emplace(id, std::make_unique<Live>(Live{id, std::move(requests[i]), std::move(samplers[i]), {},
                                                       branches, slots, std::vector<double>(branches, 0.0)}));
      }
    } catch (...) {
      for (auto id : ids) end_quietly(id);  // all or none
      throw;
    }
    work_.notify_one();
    return ids;
  }

  int64_t submit(Request request) {
    std::vector<Request> one;
    one.push_back(std::move(request));
    return submit_all(std::move(one))[0];
  }

  // Raises for a request that can never run; returns its sampler.
  Sampler check(const Request& request) const {
    TORCH_CHECK(!request.prompt.empty(), "a request needs a non-empty prompt");
    TORCH_CHECK(request.weigh_from >= 0, "weigh_from must be >= 0, got ", request.weigh_from);
    const auto& c = model_->config();
    for (auto t : request.prompt) TORCH_CHECK(t >= 0 && t < c.vocab_size, "token id ", t, " is outside the vocabulary");
    for (const auto& bias : request.params.logit_bias) {
      TORCH_CHECK(bias.first >= 0 && bias.first < c.vocab_size, "logit_bias names token id ", bias.first,
                  ", outside the vocabulary of ", c.vocab_size);
    }
    // A cartridge that does not fit the model must be refused here: inside a step it would
    // fail every request computed with it.
    for (const auto& p : request.prefixes) {
      check_prefix(p, c, "submit");
      for (int64_t l = 0; l < c.num_layers; ++l) {
        const auto &k = p->keys[l], &v = p->values[l];
        TORCH_CHECK(k.scalar_type() == model_->dtype() && v.scalar_type() == model_->dtype() &&
                        k.device().type() == model_->device().type() &&
                        v.device().type() == model_->device().type(),
                    "a cartridge's KV must be ", c10::toString(model_->dtype()), " on ", model_->device().str(),
                    " like the model");
      }
    }
    const int64_t prompt = static_cast<int64_t>(request.prompt.size());
    const int64_t needed = prefix_tokens(request) + prompt + request.params.max_new_tokens;
    if (needed > c.max_position_embeddings) {
      throw ContextLengthError("the request needs " + std::to_string(needed) + " tokens (cartridges " +
                               std::to_string(prefix_tokens(request)) + " + prompt " + std::to_string(prompt) +
                               " + max tokens " + std::to_string(request.params.max_new_tokens) +
                               "), more than the model's context of " + std::to_string(c.max_position_embeddings));
    }
    return Sampler(request.params);  // checks the sampling parameters
  }

  bool cancel(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!lives_.count(id)) return false;
    cancels_.insert(id);
    work_.notify_one();
    return true;
  }

  int events_fd() {
    std::lock_guard<std::mutex> lock(events_mutex_);
#ifdef __linux__
    if (events_fd_ < 0) {
      events_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (!events_.empty() || drained_) signal_events_fd();  // what is waiting already
    }
#endif
    return events_fd_;
  }

  bool drained() const {
    std::lock_guard<std::mutex> lock(events_mutex_);
    return drained_ && events_.empty();
  }

  std::vector<Event> poll(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(events_mutex_);
    events_ready_.wait_for(lock, timeout, [&] { return !events_.empty() || drained_; });
    std::vector<Event> out;
    out.swap(events_);
    return out;
  }

  EngineStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    EngineStats s = counters_;
    s.running = scheduler_.running();
    s.waiting = scheduler_.waiting();
    s.kv_tokens_used = scheduler_.kv_used();
    s.kv_tokens_total = options_.kv_tokens;
    s.kv_bytes = pool_.nbytes();
    s.kv_compactions = scheduler_.compactions();
    s.cartridges = cartridges_.stats();
    return s;
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      work_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

  bool running() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return !stopping_;
  }

  const EngineOptions& options() const { return options_; }
  const LlamaModel& model() const { return *model_; }
  void set_num_threads(int threads) { requested_threads_.store(std::max(1, threads)); }
  int num_threads() const { return requested_threads_.load(); }
  CartridgeCache& cartridges() { return cartridges_; }

 private:
  void run() {
#ifdef __linux__
    // Named for profilers and for benchmarks/bench_http.py, which counts the CPU time of the
    // threads outside the model's compute; the OpenMP team it starts inherits the name.
    pthread_setname_np(pthread_self(), kComputeThreadName);
#endif
    // Our kernels split their work on this pool, whose threads spin between a step's sections
    // (model/spin_pool.h).
    int threads = requested_threads_.load(), aten_threads = 0;
    auto pool = std::make_unique<SpinPool>(threads);
    PoolScope scope(pool.get());
    // ATen's operators use OpenMP with the same count, or one thread in a step that decodes or
    // prefills little (engine/step_threads.h); OpenMP's count is per thread.
    auto set_aten_threads = [&](const PackedBatch& batch) {
      const int wanted = aten_threads_for(batch, threads, model_->products_on_quantized_kernels());
      if (wanted != aten_threads) at::set_num_threads(aten_threads = wanted);
    };
    std::vector<Event> events;
    for (;;) {
      StepPlan plan;
      std::vector<SlotRun> moved;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_.wait(lock, [&] { return stopping_ || !cancels_.empty() || scheduler_.running() + scheduler_.waiting() > 0; });
        if (stopping_) {
          for (auto& [id, live] : lives_) events.push_back(finished(id, "cancelled"));
          counters_.cancelled += static_cast<int64_t>(lives_.size());
          lives_.clear();
          publish(events, /*last=*/true);
          return;
        }
        for (auto id : cancels_) {
          if (lives_.count(id)) {
            end(id, "cancelled", events);
            ++counters_.cancelled;
          }
        }
        cancels_.clear();
        plan = scheduler_.plan();
        moved = slots_to_move(plan.moves);
      }
      if (const int wanted = requested_threads_.load(); wanted != threads) {
        threads = wanted;  // OpenMP's count is per thread: only the compute thread can set its own
        pool.reset();
        pool = std::make_unique<SpinPool>(threads);
        scope.reset(pool.get());
      }
      if (!moved.empty()) move_slots(moved);
      if (!plan.empty()) step(plan, events, set_aten_threads);
      publish(events, /*last=*/false);
    }
  }

  // Pool slots whose contents move: `length` slots from `from` to `to`.
  struct SlotRun {
    int64_t from, to, length;
  };

  // The filled slots of each request the plan's compaction moved (each of a mixture's
  // sequences: the prompt tokens prefilled and every generated token but the last). Called
  // under the lock, in the moves' order.
  std::vector<SlotRun> slots_to_move(const std::vector<KVMove>& moves) const {
    std::vector<SlotRun> runs;
    for (const auto& move : moves) {
      const Live& live = *lives_.at(move.id);
      const int64_t filled =
          scheduler_.find(move.id)->prefilled + std::max<int64_t>(0, static_cast<int64_t>(live.generated.size()) - 1);
      for (int64_t b = 0; b < live.branches && filled > 0; ++b) {
        runs.push_back({move.from + b * live.slots, move.to + b * live.slots, filled});
      }
    }
    return runs;
  }

  // Moves slot contents toward the pool's start, in order (a run may overlap its own source,
  // never one still to move).
  void move_slots(const std::vector<SlotRun>& runs) {
    RECORD_FUNCTION("cartridges::compact_kv_pool", std::vector<c10::IValue>());
    ComputeLock turn;
    for (auto* slabs : {&pool_.keys, &pool_.values}) {
      for (auto& slab : *slabs) {
        for (const auto& r : runs) {
          auto source = slab.narrow(0, r.from, r.length);
          slab.narrow(0, r.to, r.length).copy_(r.to + r.length > r.from ? source.clone() : source);
        }
      }
    }
  }

  // One sequence of a step (a mixture has one per cartridge, consecutive).
  struct Part {
    Live* live;
    int64_t chunk;  // prompt tokens of this step, 0 when decoding
    int64_t start;  // prompt tokens in the pool before this step
    int64_t rows;   // logits rows it returns
  };

  // Runs one forward over the plan and samples; appends the events.
  template <typename SetThreads>
  void step(const StepPlan& plan, std::vector<Event>& events, const SetThreads& set_aten_threads) {
    PackedBatch batch;
    std::vector<int64_t> tokens;
    std::vector<Part> parts;  // per sequence; a request's sequences are consecutive
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto add = [&](int64_t id, int64_t chunk) {
        Live* live = lives_.at(id).get();
        const Scheduled* s = scheduler_.find(id);
        const auto& prompt = live->request.prompt;
        const bool own_cartridge = is_mixture(live->request);  // each sequence reads one cartridge
        for (int64_t b = 0; b < live->branches; ++b) {
          PackedSequence seq;
          seq.kv_offset = s->kv_offset + b * live->slots;
          seq.prefixes = own_cartridge ? PrefixList{live->request.prefixes[b]} : live->request.prefixes;
          if (chunk == 0) {
            // The pool holds the prompt and every generated token but the last, which is the input.
            seq.past = s->prompt_tokens + static_cast<int64_t>(live->generated.size()) - 1;
            seq.num_new = 1;
            tokens.push_back(live->generated.back());
          } else {
            seq.past = s->prefilled;
            seq.num_new = chunk;
            tokens.insert(tokens.end(), prompt.begin() + s->prefilled, prompt.begin() + s->prefilled + chunk);
            seq.logits = s->prefilled + chunk == s->prompt_tokens;
            seq.all_logits = live->branches > 1;  // a mixture weighs its cartridges by the prompt too
            if (seq.all_logits) seq.logits_from = first_weighed(live->request, s->prefilled, chunk);
          }
          const int64_t rows = seq.all_logits ? seq.num_new - seq.logits_from : (seq.logits ? 1 : 0);
          parts.push_back({live, chunk, s->prefilled, rows});
          batch.sequences.push_back(std::move(seq));
        }
      };
      for (auto id : plan.decode) add(id, 0);
      for (auto [id, chunk] : plan.prefill) add(id, chunk);
    }
    batch.tokens = at::tensor(tokens, at::kLong);
    set_aten_threads(batch);  // also follows the model's int8 setting

    at::Tensor logits;
    std::string failure;
    bool fixed_shape = fixed_decode_ != nullptr && FixedDecode::serves(batch);
    try {
      ComputeLock turn;
      if (fixed_shape) {
        try {
          logits = fixed_decode_->step(batch, pool_).to(at::kCPU);
        } catch (const std::exception& e) {
          // A step the fixed-shape path cannot take (a graph that fails to capture) must not
          // fail requests: the packed step serves this one and every later one, and says why.
          std::fprintf(stderr, "cartridges: fixed-shape decode steps turned off: %s\n", e.what());
          fixed_decode_.reset();
          fixed_shape = false;
        }
      }
      if (!fixed_shape) logits = model_->forward_packed(batch, pool_).to(at::kCPU);
    } catch (const std::exception& e) {
      failure = e.what();
    }

    RECORD_FUNCTION("cartridges::sample", std::vector<c10::IValue>());
    std::lock_guard<std::mutex> lock(mutex_);
    ++counters_.steps;
    if (fixed_shape) {
      ++counters_.fixed_shape_steps;
      counters_.cuda_graph_captures = fixed_decode_->captures();
    }
    int64_t row = 0;
    for (size_t i = 0; i < parts.size();) {
      const Part& part = parts[i];
      Live* live = part.live;  // ending the request below frees it
      const int64_t branches = live->branches, rows = part.rows * branches;
      i += branches;
      if (!failure.empty()) {
        events.push_back(finished(live->id, "error", failure));
        end_quietly(live->id);
        continue;
      }
      if (part.chunk > 0) {
        scheduler_.prefilled(live->id, part.chunk);
        counters_.prompt_tokens += part.chunk;
      }
      const bool samples = part.chunk == 0 || part.start + part.chunk == static_cast<int64_t>(live->request.prompt.size());
      if (branches == 1) {
        if (samples) sample_into(*live, logits[row], events);
      } else {
        mix_into(*live, part, logits.narrow(0, row, rows), samples, events);
      }
      row += rows;
    }
  }

  void sample_into(Live& live, const at::Tensor& logits, std::vector<Event>& events) {
    const int64_t token = emit(live, logits, events);
    end_if_done(live, token, events);
  }

  // A mixture's step: `logits` holds `part.rows` rows for each of its sequences in turn, from
  // a prefill chunk's first weighed position on. The prompt tokens of a prefill chunk add to
  // each cartridge's weight; the distribution at the last position, mixed under the weights,
  // is sampled from, and the sampled token adds too.
  void mix_into(Live& live, const Part& part, const at::Tensor& logits, bool samples, std::vector<Event>& events) {
    const int64_t n = live.branches, vocab = logits.size(-1);
    const auto logprobs = at::log_softmax(logits.view({n, part.rows, vocab}), -1);  // [n, rows, vocab]
    if (part.chunk > 0) {
      // Position j predicts prompt token start + j + 1; the prompt's last position predicts output.
      const auto& prompt = live.request.prompt;
      const int64_t end = std::min(part.chunk, static_cast<int64_t>(prompt.size()) - part.start - 1);
      const int64_t first = first_weighed(live.request, part.start, part.chunk);  // row 0
      const int64_t scored = end - first;
      if (scored > 0) {
        std::vector<int64_t> next(prompt.begin() + part.start + 1 + first, prompt.begin() + part.start + 1 + end);
        auto targets = at::tensor(next, at::kLong).view({1, scored, 1}).expand({n, scored, 1});
        auto gained = logprobs.narrow(1, 0, scored).gather(2, targets).sum({1, 2}).to(at::kDouble);
        for (int64_t b = 0; b < n; ++b) live.log_weights[b] += gained[b].item<double>();
      }
    }
    if (!samples) return;
    const auto last = logprobs.select(1, part.rows - 1);  // [n, vocab]
    if (live.request.composition == Composition::kRoute) {
      // The prompt is read: the heaviest cartridge alone decodes the reply, a request of one
      // cartridge from now on, in its sequence's KV slots (the others' go back to the pool).
      const auto chosen = std::max_element(live.log_weights.begin(), live.log_weights.end()) - live.log_weights.begin();
      live.request.prefixes = PrefixList{live.request.prefixes[chosen]};
      live.branches = 1;
      scheduler_.route(live.id, chosen);
      sample_into(live, last[chosen], events);
      return;
    }
    auto weights = at::tensor(live.log_weights, at::kDouble);
    weights = (weights - at::logsumexp(weights, 0)).to(at::kFloat);
    const auto mixed = at::logsumexp(last + weights.unsqueeze(1), 0);  // [vocab] log-probabilities
    const int64_t token = emit(live, mixed, events);
    const auto gained = last.select(1, token).to(at::kDouble);
    double highest = -std::numeric_limits<double>::infinity();
    for (int64_t b = 0; b < n; ++b) highest = std::max(highest, live.log_weights[b] += gained[b].item<double>());
    for (auto& w : live.log_weights) w -= highest;  // only differences count; keep them small
    end_if_done(live, token, events);
  }

  // Samples a token from `logits` [vocab], records it and its event; returns it.
  int64_t emit(Live& live, const at::Tensor& logits, std::vector<Event>& events) {
    const auto& params = live.request.params;
    Event e;
    e.request = live.id;
    e.token = live.sampler.sample(logits);
    if (params.logprobs > 0) {
      auto logprobs = at::log_softmax(logits, -1);
      e.logprob = logprobs[e.token].item<float>();
      auto [values, ids] = logprobs.topk(std::min<int64_t>(params.logprobs, logprobs.size(0)));
      e.top_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
      e.top_logprobs.assign(values.data_ptr<float>(), values.data_ptr<float>() + values.numel());
    }
    live.generated.push_back(e.token);
    ++counters_.generated_tokens;
    const int64_t token = e.token;
    events.push_back(std::move(e));
    return token;
  }

  // Ends the request after `token` when it is a stop token or the output is full.
  void end_if_done(Live& live, int64_t token, std::vector<Event>& events) {
    const auto& params = live.request.params;
    if (is_stop(params, token)) {
      end(live.id, "stop", events);
    } else if (static_cast<int64_t>(live.generated.size()) >= params.max_new_tokens) {
      end(live.id, "length", events);
    }
  }

  // Under mutex_: the request ends; its KV range is free at once.
  void end(int64_t id, const std::string& reason, std::vector<Event>& events) {
    events.push_back(finished(id, reason));
    end_quietly(id);
    if (reason != "cancelled") ++counters_.finished;
  }

  void end_quietly(int64_t id) {
    scheduler_.finish(id);
    lives_.erase(id);
  }

  static Event finished(int64_t id, const std::string& reason, const std::string& error = {}) {
    Event e;
    e.request = id;
    e.kind = Event::Kind::kFinished;
    e.finish_reason = reason;
    e.error = error;
    return e;
  }

  void publish(std::vector<Event>& events, bool last) {
    if (events.empty() && !last) return;
    {
      std::lock_guard<std::mutex> lock(events_mutex_);
      events_.insert(events_.end(), std::make_move_iterator(events.begin()), std::make_move_iterator(events.end()));
      if (last) drained_ = true;
      signal_events_fd();
    }
    events.clear();
    events_ready_.notify_all();
  }

  // Makes events_fd_ readable (under events_mutex_); a full counter is readable already.
  void signal_events_fd() {
    if (events_fd_ < 0) return;
    uint64_t one = 1;
    [[maybe_unused]] ssize_t written = write(events_fd_, &one, sizeof(one));
  }

  std::shared_ptr<const LlamaModel> model_;
  EngineOptions options_;

  mutable std::mutex mutex_;  // guards everything below up to the events
  std::condition_variable work_;
  Scheduler scheduler_;
  std::unordered_map<int64_t, std::unique_ptr<Live>> lives_;
  std::set<int64_t> cancels_;
  int64_t next_id_ = 0;
  bool stopping_ = false;
  EngineStats counters_;

  KVPool pool_;  // only the compute thread reads or writes it
  std::unique_ptr<FixedDecode> fixed_decode_;  // null: every step takes forward_packed
  CartridgeCache cartridges_;

  mutable std::mutex events_mutex_;
  std::condition_variable events_ready_;
  std::vector<Event> events_;
  bool drained_ = false;
  int events_fd_ = -1;  // see Engine::events_fd

  std::atomic<int> requested_threads_;
  std::thread thread_;
};

Engine::Engine(std::shared_ptr<const LlamaModel> model, EngineOptions options)
    : impl_(std::make_unique<EngineImpl>(std::move(model), options)) {}
Engine::~Engine() = default;
int64_t Engine::submit(Request request) { return impl_->submit(std::move(request)); }
std::vector<int64_t> Engine::submit_all(std::vector<Request> requests) {
  return impl_->submit_all(std::move(requests));
}
bool Engine::cancel(int64_t id) { return impl_->cancel(id); }
std::vector<Event> Engine::poll(std::chrono::milliseconds timeout) { return impl_->poll(timeout); }
int Engine::events_fd() { return impl_->events_fd(); }
bool Engine::drained() const { return impl_->drained(); }
EngineStats Engine::stats() const { return impl_->stats(); }
void Engine::set_num_threads(int threads) { impl_->set_num_threads(threads); }
int Engine::num_threads() const { return impl_->num_threads(); }
CartridgeCache& Engine::cartridges() { return impl_->cartridges(); }
const EngineOptions& Engine::options() const { return impl_->options(); }
const LlamaModel& Engine::model() const { return impl_->model(); }
void Engine::shutdown() { impl_->shutdown(); }
bool Engine::running() const { return impl_->running(); }

}  // namespace cartridges
