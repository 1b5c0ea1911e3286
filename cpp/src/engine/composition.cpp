#include "cartridges/composition.h"

#include <algorithm>
#include <numeric>

namespace cartridges {

int64_t tokens_in_front(const std::vector<int64_t>& cartridge_tokens, Composition composition) {
  if (composition != Composition::kConcatenate && cartridge_tokens.size() >= 2) {
    return *std::max_element(cartridge_tokens.begin(), cartridge_tokens.end());
  }
  return std::accumulate(cartridge_tokens.begin(), cartridge_tokens.end(), int64_t{0});
}

}  // namespace cartridges
