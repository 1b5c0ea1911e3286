// Tests' convenience for one closed batch: submits every request to an engine, waits for all,
// returns (tokens, finish_reason) per request in order.
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "cartridges/engine.h"

namespace cartridges {

struct GenerationResult {
  std::vector<int64_t> tokens;  // generated tokens, the stop token included
  std::string finish_reason;
};

inline std::vector<GenerationResult> generate_all(Engine& engine, const std::vector<Request>& requests) {
  std::unordered_map<int64_t, size_t> index;
  const auto ids = engine.submit_all(requests);
  for (size_t i = 0; i < ids.size(); ++i) index[ids[i]] = i;
  std::vector<GenerationResult> results(requests.size());
  size_t done = 0;
  while (done < requests.size()) {
    auto events = engine.poll(std::chrono::milliseconds(100));
    if (events.empty() && !engine.running()) throw EngineStoppedError("the engine stopped before the requests ended");
    for (const auto& e : events) {
      auto it = index.find(e.request);
      if (it == index.end()) continue;
      auto& r = results[it->second];
      if (e.kind == Event::Kind::kToken) {
        r.tokens.push_back(e.token);
      } else {
        if (e.finish_reason == "error") throw std::runtime_error("generation failed: " + e.error);
        r.finish_reason = e.finish_reason;
        ++done;
      }
    }
  }
  return results;
}

}  // namespace cartridges
