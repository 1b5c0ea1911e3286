#pragma once
// Cartridge training: a trainable KV prefix, the distillation loss over a packed batch, Adam,
// and the training loop (progress callback, checkpoints, resume, cancellation).

#include <ATen/ATen.h>

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "cartridges/model.h"

namespace cartridges {

// The trainable prefix: per layer, the first `num_frozen` tokens are fixed (the attention
// sink), the rest are trained. Both parts are float32 master copies [H_kv, n, D], whatever
// the model's dtype; keys after RoPE at positions 0..P-1 like any KVPrefix.
struct CartridgeParams {
  std::vector<at::Tensor> frozen_keys, frozen_values;        // [H_kv, F, D], no grad
  std::vector<at::Tensor> trainable_keys, trainable_values;  // [H_kv, P - F, D], requires grad
  std::vector<at::Tensor> biases;  // empty, or the prefix's attention biases [H_kv, P], fixed (not trained)

  // Splits `prefix` into frozen and trainable parts (copies, float32). 0 <= num_frozen < P.
  static CartridgeParams from_prefix(const KVPrefix& prefix, int64_t num_frozen);

  int64_t num_layers() const { return static_cast<int64_t>(trainable_keys.size()); }
  int64_t num_frozen() const { return frozen_keys.empty() ? 0 : frozen_keys[0].size(1); }
  int64_t num_tokens() const { return num_frozen() + (trainable_keys.empty() ? 0 : trainable_keys[0].size(1)); }
  // Trainable tensors in a fixed order: keys of every layer, then values of every layer.
  std::vector<at::Tensor> parameters() const;
  // The whole prefix in `dtype`. Differentiable with respect to the trainable tensors
  // unless `detach` (the serving copy).
  KVPrefix to_prefix(at::ScalarType dtype, at::Device device, bool detach) const;
};

// Synthetic conversations, right-padded, with the teacher's targets at the positions whose
// next-token prediction is trained. Plain next-token loss is the case K = 1 with log-prob 0.
struct TrainingData {
  at::Tensor tokens;         // [N, S] int64, row n valid up to lengths[n]
  at::Tensor lengths;        // [N] int64
  at::Tensor target_mask;    // [N, S] bool: position s is trained to predict tokens[n, s + 1]
  at::Tensor topk_ids;       // [T, K] int64, T = target_mask.sum(), row-major order of the mask
  at::Tensor topk_logprobs;  // [T, K] float32, the teacher's log-probabilities of topk_ids

  int64_t size() const { return tokens.size(0); }
  // Raises c10::Error naming the first inconsistency.
  void validate(int64_t vocab_size) const;
};

// Sum over the targets of the given rows of -sum_k p_teacher_k * log p_student(id_k), with
// the student = `model` with `params` in front (no cache). p_teacher = exp(topk_logprobs),
// NOT renormalized over the top k (the mass the teacher puts elsewhere is ignored, as in the
// original research code). Returns (loss sum, number of target positions).
// With a `companion`, rows r with r % companion_every == 0 have it in front of the cartridge, as
// another cartridge would be when several are composed: their positions start after both.
std::pair<at::Tensor, int64_t> distillation_loss_sum(const LlamaModel& model, const CartridgeParams& params,
                                                     const TrainingData& data, const std::vector<int64_t>& rows,
                                                     const PrefixPtr& companion = nullptr,
                                                     int64_t companion_every = 0);
// The same loss per target: [T] float32, the targets of rows[0] first (in sequence order), then
// those of rows[1], and so on. Its sum is distillation_loss_sum's.
at::Tensor distillation_target_losses(const LlamaModel& model, const CartridgeParams& params,
                                      const TrainingData& data, const std::vector<int64_t>& rows,
                                      const PrefixPtr& companion = nullptr, int64_t companion_every = 0);

struct AdamOptions {
  double lr = 2e-2;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // After each step, every parameter moves lr * anchor of the way back to its value when the
  // Adam was made (decoupled, like AdamW's decay but toward the start, not zero); 0: plain Adam.
  double anchor = 0.0;
};

// Adam as torch.optim.Adam computes it (no weight decay, no amsgrad), on float32 tensors.
class Adam {
 public:
  // lr_scales: one factor per parameter on the step's learning rate (empty: all 1).
  // channel_scales: per parameter, a tensor broadcast against it whose elements multiply the
  // step elementwise (empty: none).
  Adam(std::vector<at::Tensor> params, AdamOptions options, std::vector<double> lr_scales = {},
       std::vector<at::Tensor> channel_scales = {});
  // One update from the params' .grad() at learning rate `lr` (times the parameter's scale);
  // params without a gradient are skipped. Gradients are left in place (call zero_grad()).
  void step(double lr);
  void zero_grad();
  int64_t steps() const { return step_; }
  // First and second moments, one per parameter (for checkpoints).
  const std::vector<at::Tensor>& exp_avg() const { return exp_avg_; }
  const std::vector<at::Tensor>& exp_avg_sq() const { return exp_avg_sq_; }
  // Restores the state saved from an Adam over the same parameter shapes.
  void load_state(int64_t steps, const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq);

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, anchors_;
  AdamOptions options_;
  std::vector<double> lr_scales_;
  std::vector<at::Tensor> channel_scales_;
  int64_t step_ = 0;
};

enum class LossWeighting { kStep, kToken, kRow };
// "step", "token", "row"; parse_loss_weighting raises c10::Error on any other name.
const char* loss_weighting_name(LossWeighting w);
LossWeighting parse_loss_weighting(const std::string& name);

// The training loop's settings. The defaults are TrainConfig's (python/cartridges/selfstudy/
// config.py, where each is explained); tests/training/test_config.py checks that they agree.
struct TrainOptions {
  AdamOptions adam;             // lr 2e-2 by default
  int64_t epochs = 2;           // passes over the data
  int64_t batch_size = 4;       // conversations per forward/backward (micro-batch)
  int64_t grad_accum = 1;       // micro-batches per optimizer step
  bool cosine = true;           // cosine decay of lr from adam.lr to 0 (after the warmup)
  // Share of the run's steps, W = round(warmup x total) (at least 1 when warmup > 0), over which
  // the lr rises linearly to adam.lr: step s (0-based) < W takes adam.lr x (s + 1) / W. Adam's
  // first steps move every element by about the full lr whatever the gradient's noise; a warmup
  // keeps those steps small while the moment estimates settle. 0: none. In [0, 1).
  double warmup = 0.0;
  int64_t seed = 0;             // order of conversations: a permutation per epoch from (seed, epoch)
  // How a step's loss is averaged. kStep: over the step's own targets, so every step weighs the
  // same, but within a step a row of 128 targets (recall) outweighs one of 2 (cloze) 64 times.
  // kToken: the step's summed loss over the run's mean targets per step, so every target token
  // weighs the same wherever it falls. kRow: each row's mean over its own targets, averaged over
  // the step's rows, so every conversation weighs the same, a short answer as much as a long one.
  LossWeighting loss_weighting = LossWeighting::kStep;
  // Each layer's keys (values) step at lr x their initial RMS / the RMS of all the cartridge's
  // keys (values): every layer moves by the same share of its size (layer_lr_scales).
  bool layer_scaled_lr = true;
  // With layer_scaled_lr, finer: each channel (layer, head and dimension) of the keys (values)
  // steps at lr x its initial RMS over the tokens / the RMS of all the cartridge's keys (values)
  // (channel_lr_scales). Within a head, SmolLM2's key dimensions differ in size ~16x, its values' ~3x.
  bool channel_scaled_lr = true;
  std::string checkpoint_path;  // empty: no checkpoints
  int64_t checkpoint_every = 0; // steps between checkpoints (and one at the end); 0: never
  bool resume = false;          // start from checkpoint_path when it exists
  // Composition: conversations r with r % companion_every == 0 are trained with `companion` (a
  // stand-in for another cartridge) in front, so that the cartridge keeps working composed.
  PrefixPtr companion;
  int64_t companion_every = 0;  // 0: never

  // Optimizer steps of the whole run for `n` conversations.
  int64_t total_steps(int64_t n) const;
  // The learning rate of step `step` (0-based) of a run of `total` steps: warmup, then cosine.
  double lr_at(int64_t step, int64_t total) const;
};

// Per parameter of params.parameters() (keys of every layer, then values): the layer's RMS over
// its trainable tokens divided by the RMS of all trainable keys (for a key) or values (for a
// value). The KV's scale differs ~40x across layers (SmolLM2's layer-0 values have RMS 0.05,
// its last layers' 1.4), so one absolute Adam step moves some layers far more than others.
std::vector<double> layer_lr_scales(const CartridgeParams& params);
// Per parameter of params.parameters(), a [H_kv, 1, D] tensor: each channel's RMS over the
// trainable tokens divided by the RMS of all trainable keys (for a key) or values (for a value).
std::vector<at::Tensor> channel_lr_scales(const CartridgeParams& params);

// The order in which epoch `epoch` takes N conversations: a permutation drawn from (seed,
// epoch) alone, so a resumed run sees the batches of an uninterrupted one.
std::vector<int64_t> training_order(int64_t n, int64_t seed, int64_t epoch);

// `rows` (indices into `lengths`, [N] int64) split into groups of similar length for padded
// forwards, the cheapest split of the rows sorted by length when a group costs its rows times
// its longest row plus `overhead`. Self-study mixes short rows (cloze: a blank's few words) with
// long ones (recall: 128 tokens): ~30% of the rows of random padded micro-batches were padding.
// Splitting a micro-batch instead of sorting the data keeps every step a random draw: steps of
// only short rows (a few targets, yet a full Adam step) trained worse cartridges.
// What a forward call costs beyond its rows, in padded row tokens, on `device`: training's
// micro-batches and the teacher's scoring split with it. On the CPU a forward costs about its
// tokens; on a GPU a small forward's cost is its kernel launches (a training step's length
// group, forward and backward, about 3,000 of them: 75 ms of host time against a few
// microseconds of GPU time per padded token), so there rows stay in one group.
constexpr int64_t kLengthGroupOverhead = 32;
constexpr int64_t kLengthGroupOverheadGpu = 16384;
inline int64_t length_group_overhead(const c10::Device& device) {
  return device.is_cpu() ? kLengthGroupOverhead : kLengthGroupOverheadGpu;
}
std::vector<std::vector<int64_t>> length_groups(std::vector<int64_t> rows, const at::Tensor& lengths,
                                                int64_t overhead);

struct TrainProgress {
  int64_t step;   // optimizer steps done (1-based after the first)
  int64_t total;  // steps of the whole run
  double loss;    // mean loss per target token of this step
  double lr;      // learning rate this step used
};
// Called after each optimizer step, on the training thread; returning false cancels.
using ProgressCallback = std::function<bool(const TrainProgress&)>;

// Set from any thread to stop a running train_cartridge.
struct CancelToken {
  std::atomic<bool> requested{false};
};

struct TrainResult {
  int64_t steps = 0;          // optimizer steps done in total (resumed ones included)
  bool cancelled = false;
  std::vector<double> losses; // loss of each step run by this call
};

// Trains `params` in place. `cancel` (may be null) is checked before every micro-batch: a
// cancelled run stops within a step, without applying that step's partial update.
TrainResult train_cartridge(const LlamaModel& model, CartridgeParams& params, const TrainingData& data,
                            const TrainOptions& options, const ProgressCallback& on_progress = nullptr,
                            const std::atomic<bool>* cancel = nullptr);

// Checkpoint: params, Adam state and step, in torch.save's format (torch.load reads it).
void save_checkpoint(const std::string& path, const CartridgeParams& params, const Adam& adam);
// Restores params (in place, same shapes) and Adam state; returns false when `path` is absent.
bool load_checkpoint(const std::string& path, CartridgeParams& params, Adam& adam);

}  // namespace cartridges
