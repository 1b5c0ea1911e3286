// The serving engine on a tiny random model: requests that join at different moments, with
// different prompts and cartridge lists, get exactly what they get alone; cancellation,
// seeds, log-probabilities, typed errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <thread>

#ifdef __linux__
#include <poll.h>
#include <unistd.h>
#endif

#include "cartridges/engine.h"
#include "cartridges/model.h"
#include "tiny_model.h"
#include "generate_all.h"

using namespace cartridges;
using cartridges::test_models::random_weights;
using cartridges::test_models::tiny_config;

namespace {

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::manual_seed(0);
    config = tiny_config();
    model = std::make_shared<LlamaModel>(config, random_weights(config), at::kCPU, at::kFloat);
  }

  std::vector<int64_t> random_tokens(int64_t n) {
    auto t = at::randint(config.vocab_size, {n}, at::kLong);
    return {t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n};
  }
  PrefixPtr prefix(const std::vector<int64_t>& tokens) {
    return std::make_shared<const KVPrefix>(model->prefix_from_tokens(at::tensor(tokens, at::kLong)));
  }
  Request greedy(std::vector<int64_t> prompt, int64_t max_new, PrefixList prefixes = {}) {
    Request r;
    r.prompt = std::move(prompt);
    r.prefixes = std::move(prefixes);
    r.params.max_new_tokens = max_new;
    return r;
  }
  GenerationResult alone(const Request& r) {
    Engine e(model);
    return generate_all(e, {r})[0];
  }

  LlamaConfig config;
  std::shared_ptr<LlamaModel> model;
};

// Collects events per request until every id given has finished.
std::map<int64_t, GenerationResult> drain(Engine& engine, std::set<int64_t> pending) {
  std::map<int64_t, GenerationResult> out;
  while (!pending.empty()) {
    for (const auto& e : engine.poll(std::chrono::milliseconds(100))) {
      if (e.kind == Event::Kind::kToken) {
        out[e.request].tokens.push_back(e.token);
      } else {
        out[e.request].finish_reason = e.finish_reason;
        pending.erase(e.request);
      }
    }
  }
  return out;
}

// The token events of request `id` (others are dropped) until it finishes.
std::vector<Event> token_events(Engine& engine, int64_t id) {
  std::vector<Event> tokens;
  for (bool done = false; !done;) {
    for (auto& e : engine.poll(std::chrono::milliseconds(100))) {
      if (e.request == id && e.kind == Event::Kind::kToken) tokens.push_back(e);
      done = done || (e.request == id && e.kind == Event::Kind::kFinished);
    }
  }
  return tokens;
}

}  // namespace

TEST_F(EngineTest, RequestsJoiningAtAnyStepGetWhatTheyGetAlone) {
  auto doc_a = random_tokens(7), doc_b = random_tokens(5);
  auto a = prefix(doc_a), b = prefix(doc_b);
  std::vector<Request> requests = {
      greedy(random_tokens(3), 12),           greedy(random_tokens(20), 8, {a}),
      greedy(random_tokens(6), 10, {a, b}),   greedy(random_tokens(11), 9, {b}),
      greedy(random_tokens(2), 14, {a}),      greedy(random_tokens(40), 5),  // longer than a prefill step
      greedy(random_tokens(30), 7, {a, b}),   // a mixture: two sequences, prompt scored in chunks
  };
  requests[2].composition = Composition::kConcatenate;  // the other mixture is the default's
  EngineOptions options;
  options.prefill_tokens_per_step = 16;
  Engine engine(model, options);
  std::set<int64_t> ids;
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto id = engine.submit(requests[i]);
    ids.insert(id);
    index[id] = i;
    std::this_thread::sleep_for(std::chrono::milliseconds(2 * i));  // join at different steps
  }
  auto results = drain(engine, ids);
  for (const auto& [id, got] : results) {
    const auto& r = requests[index[id]];
    auto expected = alone(r);
    EXPECT_EQ(got.tokens, expected.tokens) << "request " << index[id];
    EXPECT_EQ(got.finish_reason, "length");
  }
  // A cartridge equals its text in context (here: the KV of that very text).
  auto in_context = requests[1];
  in_context.prefixes.clear();
  std::vector<int64_t> text = doc_a;
  text.insert(text.end(), requests[1].prompt.begin(), requests[1].prompt.end());
  in_context.prompt = text;
  EXPECT_EQ(alone(in_context).tokens, alone(requests[1]).tokens);
  auto stats = engine.stats();
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.kv_tokens_used, 0);
  EXPECT_EQ(stats.finished, static_cast<int64_t>(requests.size()));
}

TEST_F(EngineTest, CancelledRequestFreesItsPlaceAndOthersGoOn) {
  EngineOptions options;
  options.kv_tokens = 260;  // room for one long request at a time
  Engine engine(model, options);
  // As long as the tiny model's context allows, so that it is still running when cancelled.
  auto long_request = greedy(random_tokens(4), 240);
  auto waiting = greedy(random_tokens(5), 20);
  auto running_id = engine.submit(long_request);
  auto waiting_id = engine.submit(waiting);
  auto queued_id = engine.submit(greedy(random_tokens(3), 100));
  // Let the first produce a few tokens, then cancel it and the queued third.
  int64_t produced = 0;
  while (produced < 3) {
    for (const auto& e : engine.poll(std::chrono::milliseconds(100))) produced += e.request == running_id;
  }
  EXPECT_TRUE(engine.cancel(running_id));
  EXPECT_TRUE(engine.cancel(queued_id));
  auto results = drain(engine, {running_id, waiting_id, queued_id});
  EXPECT_EQ(results[running_id].finish_reason, "cancelled");
  EXPECT_EQ(results[queued_id].finish_reason, "cancelled");
  EXPECT_TRUE(results[queued_id].tokens.empty());
  EXPECT_EQ(results[waiting_id].tokens, alone(waiting).tokens);
  EXPECT_FALSE(engine.cancel(running_id));
  EXPECT_EQ(engine.stats().kv_tokens_used, 0);
}

// A request that fits the pool's free slots but none of its free ranges starts after the
// running requests' KV is packed toward the pool's start; they go on as if nothing moved, a
// mixture's sequences included.
TEST_F(EngineTest, RequestsGetWhatTheyGetAloneAcrossAPoolCompaction) {
  EngineOptions options;
  options.kv_tokens = 160;
  Engine engine(model, options);
  auto a = prefix(random_tokens(6)), b = prefix(random_tokens(4));
  std::vector<Request> requests = {
      greedy(random_tokens(4), 10),          // [0, 14): ends first
      greedy(random_tokens(5), 25, {a, b}),  // a mixture, two ranges of 30: [14, 74)
      greedy(random_tokens(3), 30),          // [74, 107)
      greedy(random_tokens(6), 52),          // 58 slots: 53 free at the end, 67 in all once the first ends
  };
  auto ids = engine.submit_all(requests);
  auto results = drain(engine, {ids.begin(), ids.end()});
  EXPECT_EQ(engine.stats().kv_compactions, 1);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(results[ids[i]].tokens, alone(requests[i]).tokens) << "request " << i;
  }
  EXPECT_EQ(engine.stats().kv_tokens_used, 0);
}

TEST_F(EngineTest, SeededSamplingRepeatsAndSeedsDiffer) {
  Engine engine(model);
  auto r = greedy(random_tokens(4), 24);
  r.params.temperature = 1.0;
  r.params.top_p = 0.95;
  r.params.top_k = 40;
  r.params.seed = 7;
  auto other = r;
  other.params.seed = 8;
  auto results = generate_all(engine, {r, r, other});
  EXPECT_EQ(results[0].tokens, results[1].tokens);
  EXPECT_NE(results[0].tokens, results[2].tokens);
}

TEST_F(EngineTest, LogProbabilitiesEqualAFullForward) {
  Engine engine(model);
  auto doc = random_tokens(6);
  auto r = greedy(random_tokens(5), 6, {prefix(doc)});
  r.params.logprobs = 5;
  const auto tokens = token_events(engine, engine.submit(r));
  ASSERT_EQ(tokens.size(), 6u);
  std::vector<int64_t> seq = doc;
  seq.insert(seq.end(), r.prompt.begin(), r.prompt.end());
  for (const auto& e : tokens) seq.push_back(e.token);
  auto full = model->forward({at::tensor(seq, at::kLong).view({1, -1}), {}, {}}, nullptr)[0];
  auto logprobs = at::log_softmax(full, -1);
  const int64_t first = static_cast<int64_t>(doc.size() + r.prompt.size()) - 1;
  for (size_t i = 0; i < tokens.size(); ++i) {
    auto row = logprobs[first + static_cast<int64_t>(i)];
    EXPECT_NEAR(tokens[i].logprob, row[tokens[i].token].item<float>(), 1e-4);
    auto [values, ids] = row.topk(5);
    for (int64_t k = 0; k < 5; ++k) {
      EXPECT_EQ(tokens[i].top_ids[k], ids[k].item<int64_t>());
      EXPECT_NEAR(tokens[i].top_logprobs[k], values[k].item<float>(), 1e-4);
    }
    EXPECT_EQ(tokens[i].top_ids[0], tokens[i].token);  // greedy
  }
}

TEST_F(EngineTest, TypedErrors) {
  EngineOptions options;
  options.kv_tokens = 64;
  options.max_waiting = 1;
  options.max_running = 1;
  Engine engine(model, options);
  EXPECT_THROW(engine.submit(greedy(random_tokens(10), 250)), ContextLengthError);  // > context of 256
  EXPECT_THROW(engine.submit(greedy(random_tokens(10), 60)), ContextLengthError);   // > the whole pool
  EXPECT_THROW(engine.submit(greedy({}, 5)), c10::Error);
  EXPECT_THROW(engine.submit(greedy({config.vocab_size}, 5)), c10::Error);
  auto negative = greedy(random_tokens(2), 5);
  negative.params.logprobs = -1;
  EXPECT_THROW(engine.submit(negative), c10::Error);
  // Cartridges that do not fit the model are refused at submit, not inside a step.
  auto good = prefix(random_tokens(4));
  auto as_double = std::make_shared<KVPrefix>(*good);
  for (auto& t : as_double->keys) t = t.to(at::kDouble);
  for (auto& t : as_double->values) t = t.to(at::kDouble);
  auto empty = std::make_shared<KVPrefix>(*good);
  for (auto& t : empty->keys) t = t.narrow(1, 0, 0);
  for (auto& t : empty->values) t = t.narrow(1, 0, 0);
  auto short_one = std::make_shared<KVPrefix>(*good);
  short_one->values.pop_back();
  auto few_biases = std::make_shared<KVPrefix>(*good);  // biases for one layer only
  few_biases->biases.push_back(at::zeros({config.num_kv_heads, good->num_tokens()}));
  auto long_biases = std::make_shared<KVPrefix>(*good);  // a bias per token and one more
  for (size_t l = 0; l < good->keys.size(); ++l) {
    long_biases->biases.push_back(at::zeros({config.num_kv_heads, good->num_tokens() + 1}));
  }
  for (const PrefixPtr& bad : {PrefixPtr(as_double), PrefixPtr(empty), PrefixPtr(short_one), PrefixPtr(few_biases),
                               PrefixPtr(long_biases)}) {
    EXPECT_THROW(engine.submit(greedy(random_tokens(2), 5, {bad})), c10::Error);
  }
  EXPECT_EQ(engine.stats().waiting + engine.stats().running, 0);
  engine.submit(greedy(random_tokens(2), 40));
  // One runs (or waits), one more may wait; then the queue is full.
  bool busy = false;
  for (int i = 0; i < 3 && !busy; ++i) {
    try {
      engine.submit(greedy(random_tokens(2), 40));
    } catch (const EngineBusyError&) {
      busy = true;
    }
  }
  EXPECT_TRUE(busy);
  engine.shutdown();
  EXPECT_THROW(engine.submit(greedy(random_tokens(2), 4)), EngineStoppedError);
}

#ifdef __linux__
// The events file descriptor turns readable when a step publishes and at shutdown; poll(0)
// then takes the events without waiting, and drained() says when the last are out.
TEST_F(EngineTest, EventsFdSignalsPublishedEventsAndTheShutdown) {
  Engine engine(model);
  int fd = engine.events_fd();
  ASSERT_GE(fd, 0);
  EXPECT_EQ(engine.events_fd(), fd);  // one descriptor per engine
  auto readable = [&](int timeout_ms) {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, timeout_ms) == 1 && (p.revents & POLLIN);
  };
  auto reset = [&] {
    uint64_t count = 0;
    return ::read(fd, &count, sizeof(count)) == sizeof(count) && count > 0;
  };
  EXPECT_FALSE(readable(0));
  int64_t id = engine.submit(greedy(random_tokens(6), 3));
  std::vector<Event> seen;
  while (seen.empty() || seen.back().kind != Event::Kind::kFinished) {
    ASSERT_TRUE(readable(5000));
    ASSERT_TRUE(reset());
    for (auto& e : engine.poll(std::chrono::milliseconds(0))) seen.push_back(e);
  }
  EXPECT_EQ(seen.size(), 4u);  // three tokens, then the end
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [&](const Event& e) { return e.request == id; }));
  EXPECT_FALSE(engine.drained());
  engine.shutdown();
  ASSERT_TRUE(readable(5000));  // the shutdown's last publish
  engine.poll(std::chrono::milliseconds(0));
  EXPECT_TRUE(engine.drained());
}
#endif

TEST_F(EngineTest, ThreadCountChangesBetweenStepsWithoutDisturbingRequests) {
  EngineOptions options;
  options.num_threads = 2;
  Engine engine(model, options);
  EXPECT_EQ(engine.num_threads(), 2);
  auto r = greedy(random_tokens(6), 40);
  auto id = engine.submit(r);
  engine.set_num_threads(1);  // lands while the request runs
  auto results = drain(engine, {id});
  EXPECT_EQ(engine.num_threads(), 1);
  EXPECT_EQ(results[id].tokens, alone(r).tokens);
  engine.set_num_threads(0);
  EXPECT_EQ(engine.num_threads(), 1);  // at least one
}

TEST_F(EngineTest, MixtureOfOneCartridgeTwiceIsThatCartridge) {
  auto doc = random_tokens(6);
  auto a = prefix(doc);
  auto single = greedy(random_tokens(9), 10, {a});
  auto twice = single;
  twice.prefixes = {a, prefix(doc)};  // equal KV, two objects: two sequences mixed
  twice.composition = Composition::kMixture;
  EXPECT_EQ(alone(twice).tokens, alone(single).tokens);
  twice.prefixes = {a, a};  // the same object: composed once
  EXPECT_EQ(alone(twice).tokens, alone(single).tokens);
}

// Each generated token's log-probability is the mixture's: every cartridge's next-token
// distribution weighted by the likelihood that cartridge gave to the prompt from weigh_from on
// and the output before it, computed here from full forwards with each document in context.
class MixtureTest : public EngineTest {
 protected:
  void expect_weighs_from(std::vector<int64_t> prompt, int64_t weigh_from);
};

void MixtureTest::expect_weighs_from(std::vector<int64_t> prompt, int64_t weigh_from) {
  const std::vector<std::vector<int64_t>> docs = {random_tokens(6), random_tokens(9)};
  auto r = greedy(std::move(prompt), 8, {prefix(docs[0]), prefix(docs[1])});
  r.composition = Composition::kMixture;
  r.weigh_from = weigh_from;
  r.params.logprobs = 3;
  EngineOptions options;
  options.prefill_tokens_per_step = 10;  // the prompt is scored over two steps
  Engine engine(model, options);
  const auto tokens = token_events(engine, engine.submit(r));
  ASSERT_EQ(tokens.size(), 8u);
  std::vector<int64_t> text = r.prompt;
  for (const auto& e : tokens) text.push_back(e.token);
  // per_token[c][j]: log p(text[j] | doc c, text[<j]) for j >= 1.
  std::vector<at::Tensor> per_token, rows;
  for (const auto& doc : docs) {
    std::vector<int64_t> seq = doc;
    seq.insert(seq.end(), text.begin(), text.end());
    auto logprobs = at::log_softmax(model->forward({at::tensor(seq, at::kLong).view({1, -1}), {}, {}}, nullptr)[0], -1);
    auto own = logprobs.narrow(0, static_cast<int64_t>(doc.size()) - 1, static_cast<int64_t>(text.size()));
    rows.push_back(own);  // row j predicts text[j]
    per_token.push_back(own.gather(1, at::tensor(text, at::kLong).view({-1, 1})).squeeze(1));
  }
  const int64_t prompt_tokens = static_cast<int64_t>(r.prompt.size());
  const int64_t from = std::clamp<int64_t>(weigh_from, 1, prompt_tokens);  // the output always counts
  for (int64_t i = 0; i < 8; ++i) {
    const int64_t at_token = prompt_tokens + i;
    std::vector<at::Tensor> weighted, befores;
    for (size_t c = 0; c < docs.size(); ++c) {
      befores.push_back(per_token[c].narrow(0, from, at_token - from).sum());  // text[from .. at_token - 1]
      weighted.push_back(rows[c][at_token] + befores.back());
    }
    // log sum_c w_c p_c(v), with w_c = exp(before_c) / sum_c' exp(before_c').
    auto mixture = at::logsumexp(at::stack(weighted), 0) - at::logsumexp(at::stack(befores), 0);
    EXPECT_NEAR(tokens[i].logprob, mixture[tokens[i].token].item<float>(), 2e-4) << "token " << i;
    EXPECT_EQ(tokens[i].top_ids[0], mixture.argmax().item<int64_t>());  // greedy from the mixture
  }
}

TEST_F(MixtureTest, WeighsEachCartridgeByTheLikelihoodOfWhatCameBefore) {
  expect_weighs_from(random_tokens(12), 0);
}

// Prompt tokens before weigh_from (here past the first prefill step) add nothing to the weights.
TEST_F(MixtureTest, WeighsFromTheGivenPromptToken) {
  expect_weighs_from(random_tokens(14), 11);
  expect_weighs_from(random_tokens(14), 3);
}

TEST_F(MixtureTest, WeighingFromPastThePromptCountsTheOutputOnly) {
  expect_weighs_from(random_tokens(5), 40);
}

// Each cartridge of a mixture has its own sequence: only the longest takes context in front,
// while the pool holds the prompt and output once per cartridge.
TEST_F(EngineTest, MixtureNeedsTheLongestCartridgesContextAndAPoolRangePerCartridge) {
  EngineOptions options;
  options.kv_tokens = 150;
  Engine engine(model, options);
  auto r = greedy(random_tokens(10), 60, {prefix(random_tokens(100)), prefix(random_tokens(100))});
  r.composition = Composition::kConcatenate;
  EXPECT_THROW(engine.submit(r), ContextLengthError);  // concatenated: 200 + 10 + 60 > context of 256
  r.composition = Composition::kMixture;
  EXPECT_EQ(generate_all(engine, {r})[0].tokens.size(), 60u);  // 100 + 10 + 60 fits; 2 x 70 slots fit the pool
  r.params.max_new_tokens = 70;
  try {
    engine.submit(r);  // 2 x 80 slots > 150
    ADD_FAILURE() << "a mixture larger than the pool was queued";
  } catch (const ContextLengthError& e) {
    EXPECT_NE(std::string(e.what()).find("for each of its 2 sequences"), std::string::npos) << e.what();
  }
}
