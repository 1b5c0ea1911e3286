#pragma once
// How the cartridges of one request are composed.

#include <cstdint>
#include <vector>

namespace cartridges {

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
  // As kMixture while the prompt is read; at its end only the cartridge with the most weight
  // goes on, and the reply is decoded with it alone: one sequence a step, and one sequence's
  // KV, instead of one per cartridge, for the parts of one corpus, where the question's own
  // part takes nearly all the weight (docs/experiments.md, "Does a cartridge per part of a
  // long corpus, composed by mixture, remember more of it?").
  kRoute = 2,
};

// Context positions the cartridges of one request take in front of its prompt, given each
// cartridge's length: all of them one after another, or, in a mixture (or route) of two or more, the
// longest alone (each cartridge has its own sequence). The one rule of a request's context
// arithmetic, for the engine and for the server's checks alike.
int64_t tokens_in_front(const std::vector<int64_t>& cartridge_tokens, Composition composition);

}  // namespace cartridges
