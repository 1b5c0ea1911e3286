#include "engine/cuda_graph.h"

#include <c10/util/Exception.h>

#ifdef CARTRIDGES_CUDA_GRAPHS
#include <c10/core/Event.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace cartridges {

#ifdef CARTRIDGES_CUDA_GRAPHS

namespace {

class CudaStepGraph : public StepGraph {
 public:
  const at::Tensor& replay() override {
    graph.replay();
    return output;
  }
  at::cuda::CUDAGraph graph;
  c10::cuda::MempoolId_t pool{0, 0};
  at::Tensor output;
};

}  // namespace

bool cuda_graphs_built() { return true; }

std::unique_ptr<StepGraph> capture_step_graph(const std::function<at::Tensor()>& body,
                                              const StepGraph* share_memory_with) {
  auto captured = std::make_unique<CudaStepGraph>();
  // A capture must not run on the legacy default stream: take a side stream that first waits
  // for the work already queued, and make the caller's stream wait for it afterwards.
  auto caller = at::cuda::getCurrentCUDAStream();
  auto side = at::cuda::getStreamFromPool();
  c10::Event queued(c10::DeviceType::CUDA), done(c10::DeviceType::CUDA);
  queued.record(caller);
  queued.block(side);
  {
    c10::cuda::CUDAStreamGuard guard(side);
    body();
    const auto* shared = static_cast<const CudaStepGraph*>(share_memory_with);
    // Thread-local capture: other threads (a training step, a cartridge upload) may use the
    // GPU meanwhile without invalidating it.
    captured->graph.capture_begin(shared != nullptr ? shared->pool : c10::cuda::MempoolId_t{0, 0},
                                  cudaStreamCaptureModeThreadLocal);
    try {
      captured->output = body();
    } catch (...) {
      captured->graph.capture_end();
      throw;
    }
    captured->graph.capture_end();
    captured->pool = captured->graph.pool();
  }
  done.record(side);
  done.block(caller);
  return captured;
}

#else

bool cuda_graphs_built() { return false; }

std::unique_ptr<StepGraph> capture_step_graph(const std::function<at::Tensor()>&, const StepGraph*) {
  TORCH_CHECK(false, "this build of cartridges_core has no CUDA graphs (torch without CUDA)");
}

#endif

}  // namespace cartridges
