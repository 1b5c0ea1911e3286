#pragma once
// CUDA graphs of the engine's steps. Built where torch has CUDA (CARTRIDGES_CUDA_GRAPHS);
// elsewhere cuda_graphs_built() is false and nothing captures.

#include <ATen/ATen.h>

#include <functional>
#include <memory>

namespace cartridges {

// Whether this build of the core can capture CUDA graphs.
bool cuda_graphs_built();

// Work captured once and replayed: every launch of the captured call again, on the current
// stream, without the host's per-operator work. The inputs it reads must be written in place
// (same tensors) before each replay.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
  // Replays the work; returns the tensor the captured call returned, overwritten.
  virtual const at::Tensor& replay() = 0;
};

// Runs `body` once eagerly (it must be safe to run twice: cuBLAS handles and the allocator's
// blocks are made outside the capture), then captures it on a side stream. Graphs captured
// with the same `share_memory_with` share one memory pool: they must never replay at once.
std::unique_ptr<StepGraph> capture_step_graph(const std::function<at::Tensor()>& body,
                                              const StepGraph* share_memory_with);

}  // namespace cartridges
