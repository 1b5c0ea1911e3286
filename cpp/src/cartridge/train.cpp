// The training loop: shuffled micro-batches, gradient accumulation, Adam, cosine schedule,
// checkpoints and resume, cancellation.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>

#include "cartridges/cartridge.h"
#include "cartridges/compute.h"

namespace cartridges {

namespace {

constexpr double kPi = 3.14159265358979323846;

std::vector<at::Tensor> list_of(const c10::Dict<std::string, at::Tensor>& dict, const std::string& name, size_t n) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < n; ++i) {
    const auto key = name + "." + std::to_string(i);
    TORCH_CHECK(dict.contains(key), "checkpoint: missing '", key, "'");
    out.push_back(dict.at(key));
  }
  return out;
}

}  // namespace

std::vector<int64_t> training_order(int64_t n, int64_t seed, int64_t epoch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed) * 1000003ULL + epoch);
  auto perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
  return std::vector<int64_t>(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n);
}

std::vector<std::vector<int64_t>> length_groups(std::vector<int64_t> rows, const at::Tensor& lengths,
                                                int64_t overhead) {
  auto length = lengths.accessor<int64_t, 1>();
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) { return length[a] < length[b]; });
  const size_t n = rows.size();
  // best[j]: the cheapest cost of the first j sorted rows; cut[j]: where its last group starts.
  std::vector<int64_t> best(n + 1, std::numeric_limits<int64_t>::max()), cut(n + 1, 0);
  best[0] = 0;
  for (size_t j = 1; j <= n; ++j) {
    for (size_t i = 0; i < j; ++i) {
      const int64_t cost = best[i] + static_cast<int64_t>(j - i) * length[rows[j - 1]] + overhead;
      if (cost < best[j]) best[j] = cost, cut[j] = i;
    }
  }
  std::vector<std::vector<int64_t>> groups;
  for (size_t j = n; j > 0; j = cut[j]) groups.emplace_back(rows.begin() + cut[j], rows.begin() + j);
  std::reverse(groups.begin(), groups.end());
  return groups;
}

const char* loss_weighting_name(LossWeighting w) {
  switch (w) {
    case LossWeighting::kStep: return "step";
    case LossWeighting::kToken: return "token";
    case LossWeighting::kRow: return "row";
  }
  return "?";
}

LossWeighting parse_loss_weighting(const std::string& name) {
  for (auto w : {LossWeighting::kStep, LossWeighting::kToken, LossWeighting::kRow}) {
    if (name == loss_weighting_name(w)) return w;
  }
  TORCH_CHECK(false, "loss weighting must be \"step\", \"token\" or \"row\", got \"", name, "\"");
}

int64_t TrainOptions::total_steps(int64_t n) const {
  const int64_t per_step = batch_size * grad_accum;
  return epochs * ((n + per_step - 1) / per_step);
}

double TrainOptions::lr_at(int64_t step, int64_t total) const {
  TORCH_CHECK(warmup >= 0.0 && warmup < 1.0, "lr_at: warmup must be in [0, 1), got ", warmup);
  TORCH_CHECK(step >= 0 && step < total, "lr_at: step ", step, " is not in a run of ", total, " steps");
  const int64_t warmup_steps =
      warmup > 0.0 ? std::max<int64_t>(1, std::llround(warmup * static_cast<double>(total))) : 0;
  if (step < warmup_steps) return adam.lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (!cosine) return adam.lr;
  const double progress = static_cast<double>(step - warmup_steps) / static_cast<double>(total - warmup_steps);
  return adam.lr * 0.5 * (1.0 + std::cos(kPi * progress));
}

// On disk: a flat tuple (name, tensor, name, tensor, ...). A tuple carries no type tags, so
// torch.load(weights_only=True) reads it: dict(zip(t[::2], t[1::2])).
void save_checkpoint(const std::string& path, const CartridgeParams& params, const Adam& adam) {
  std::vector<c10::IValue> items;
  auto put_one = [&](const std::string& name, const at::Tensor& t) {
    items.emplace_back(name);
    items.emplace_back(t.detach().cpu().contiguous());
  };
  put_one("step", at::scalar_tensor(adam.steps(), at::kLong));
  auto put = [&](const std::string& name, const std::vector<at::Tensor>& list) {
    for (size_t i = 0; i < list.size(); ++i) put_one(name + "." + std::to_string(i), list[i]);
  };
  put("frozen_keys", params.frozen_keys);
  put("frozen_values", params.frozen_values);
  put("params", params.parameters());
  put("exp_avg", adam.exp_avg());
  put("exp_avg_sq", adam.exp_avg_sq());
  const auto bytes = torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(items)));
  // Written aside and renamed: a crash never leaves a partial checkpoint under `path`.
  const auto tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.good(), "checkpoint: cannot write ", tmp);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    TORCH_CHECK(out.good(), "checkpoint: write to ", tmp, " failed");
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint: cannot rename ", tmp, " to ", path);
}

bool load_checkpoint(const std::string& path, CartridgeParams& params, Adam& adam) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return false;
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto value = torch::jit::pickle_load(bytes);
  TORCH_CHECK(value.isTuple(), "checkpoint ", path, ": not a cartridge checkpoint");
  const auto& elements = value.toTupleRef().elements();
  TORCH_CHECK(elements.size() % 2 == 0, "checkpoint ", path, ": not a cartridge checkpoint");
  c10::Dict<std::string, at::Tensor> dict;
  for (size_t i = 0; i < elements.size(); i += 2) {
    TORCH_CHECK(elements[i].isString() && elements[i + 1].isTensor(), "checkpoint ", path, ": malformed entry");
    dict.insert(elements[i].toStringRef(), elements[i + 1].toTensor());
  }
  TORCH_CHECK(dict.contains("step"), "checkpoint ", path, ": missing 'step'");
  auto current = params.parameters();
  auto saved = list_of(dict, "params", current.size());
  auto frozen_keys = list_of(dict, "frozen_keys", params.frozen_keys.size());
  auto frozen_values = list_of(dict, "frozen_values", params.frozen_values.size());
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < current.size(); ++i) {
    TORCH_CHECK(saved[i].sizes() == current[i].sizes(), "checkpoint ", path, ": tensor ", i, " has shape ",
                saved[i].sizes(), ", the cartridge ", current[i].sizes());
    current[i].copy_(saved[i]);
  }
  for (size_t l = 0; l < frozen_keys.size(); ++l) {
    TORCH_CHECK(frozen_keys[l].sizes() == params.frozen_keys[l].sizes(), "checkpoint ", path,
                ": frozen tokens differ in shape");
    params.frozen_keys[l].copy_(frozen_keys[l]);
    params.frozen_values[l].copy_(frozen_values[l]);
  }
  adam.load_state(dict.at("step").item<int64_t>(), list_of(dict, "exp_avg", current.size()),
                  list_of(dict, "exp_avg_sq", current.size()));
  return true;
}

namespace {

// The RMS of every element of `group` (all layers' keys, or all values), in double.
double group_rms(const std::vector<at::Tensor>& group, const char* caller) {
  double total_sq = 0.0, total_n = 0.0;
  for (const auto& t : group) {
    total_sq += t.detach().to(at::kDouble).square().sum().item<double>();
    total_n += static_cast<double>(t.numel());
  }
  const double rms = std::sqrt(total_sq / std::max(total_n, 1.0));
  TORCH_CHECK(rms > 0, caller, ": the cartridge's keys or values are all zero");
  return rms;
}

}  // namespace

std::vector<double> layer_lr_scales(const CartridgeParams& params) {
  at::NoGradGuard no_grad;
  std::vector<double> scales;
  for (const auto* group : {&params.trainable_keys, &params.trainable_values}) {
    const double rms = group_rms(*group, "layer_lr_scales");
    for (const auto& t : *group) {
      scales.push_back(t.detach().to(at::kDouble).square().mean().sqrt().item<double>() / rms);
    }
  }
  return scales;
}

std::vector<at::Tensor> channel_lr_scales(const CartridgeParams& params) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> scales;
  for (const auto* group : {&params.trainable_keys, &params.trainable_values}) {
    const double rms = group_rms(*group, "channel_lr_scales");
    for (const auto& t : *group) {
      // [H_kv, T, D] -> [H_kv, 1, D]: each channel's RMS over the tokens.
      scales.push_back(t.detach().to(at::kDouble).square().mean({1}, /*keepdim=*/true).sqrt().div(rms).to(at::kFloat));
    }
  }
  return scales;
}

// Longer than 60 lines: the parts of an optimizer step (the epoch's order, micro-batches, length
// groups, weighting, cancellation, checkpoint) share the step's state; apart they would pass it all.
TrainResult train_cartridge(const LlamaModel& model, CartridgeParams& params, const TrainingData& data,
                            const TrainOptions& options, const ProgressCallback& on_progress,
                            const std::atomic<bool>* cancel) {
  data.validate(model.config().vocab_size);
  TORCH_CHECK(options.batch_size > 0 && options.grad_accum > 0 && options.epochs > 0,
              "train_cartridge: batch_size, grad_accum and epochs must be positive");
  TORCH_CHECK(options.warmup >= 0.0 && options.warmup < 1.0, "train_cartridge: warmup must be in [0, 1), got ",
              options.warmup);
  TORCH_CHECK(!options.resume || !options.checkpoint_path.empty(), "train_cartridge: resume needs a checkpoint_path");
  // Scales from the initialization (before a resume loads the trained tensors), as the anchor.
  const bool per_layer = options.layer_scaled_lr && !options.channel_scaled_lr;
  const bool per_channel = options.layer_scaled_lr && options.channel_scaled_lr;
  Adam adam(params.parameters(), options.adam, per_layer ? layer_lr_scales(params) : std::vector<double>{},
            per_channel ? channel_lr_scales(params) : std::vector<at::Tensor>{});
  if (options.resume) load_checkpoint(options.checkpoint_path, params, adam);

  const int64_t n = data.size();
  const int64_t per_step = options.batch_size * options.grad_accum;
  const int64_t steps_per_epoch = (n + per_step - 1) / per_step;
  const int64_t total = options.total_steps(n);
  TORCH_CHECK(adam.steps() <= total, "train_cartridge: the checkpoint is at step ", adam.steps(), " of a run of ",
              total);
  auto counts = data.target_mask.sum(1);
  auto counts_a = counts.accessor<int64_t, 1>();
  // kToken: every step's loss sum is divided by the same number, the targets of an average step,
  // so that each target token weighs the same wherever it falls.
  const double mean_step_targets =
      std::max(1.0, static_cast<double>(counts.sum().item<int64_t>()) * static_cast<double>(per_step) / n);
  auto cancelled = [&] { return cancel != nullptr && cancel->load(); };

  TrainResult result;
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  while (adam.steps() < total) {
    const int64_t step = adam.steps();
    const int64_t epoch = step / steps_per_epoch, j = step % steps_per_epoch;
    if (epoch != order_epoch) {
      order = training_order(n, options.seed, epoch);
      order_epoch = epoch;
    }
    const int64_t begin = j * per_step, end = std::min(begin + per_step, n);
    int64_t step_targets = 0;
    for (int64_t i = begin; i < end; ++i) step_targets += counts_a[order[i]];
    const double divisor = options.loss_weighting == LossWeighting::kToken ? mean_step_targets
                           : options.loss_weighting == LossWeighting::kRow ? static_cast<double>(end - begin)
                                                                      : static_cast<double>(step_targets);

    double step_loss = 0.0;
    for (int64_t mb = begin; mb < end && !result.cancelled; mb += options.batch_size) {
      if (cancelled()) {
        result.cancelled = true;
        break;
      }
      std::vector<int64_t> rows(order.begin() + mb, order.begin() + std::min(mb + options.batch_size, end));
      // The micro-batch's gradient as the sum of its length groups' (the same sum, less padding).
      for (const auto& group : length_groups(rows, data.lengths, length_group_overhead(model.device()))) {
        ComputeLock turn;  // takes turns with the serving engine instead of oversubscribing cores
        auto losses =
            distillation_target_losses(model, params, data, group, options.companion, options.companion_every);
        auto loss_sum = losses.sum();
        if (options.loss_weighting == LossWeighting::kRow) {
          // Each target weighs 1 / its row's targets: every row's mean counts once.
          std::vector<float> weights;
          for (int64_t r : group) weights.insert(weights.end(), counts_a[r], 1.0f / static_cast<float>(counts_a[r]));
          (losses * at::tensor(weights).to(losses.device())).sum().div(divisor).backward();
        } else {
          loss_sum.div(divisor).backward();
        }
        // Reported: the step's mean loss per target, whatever the weighting.
        step_loss += loss_sum.item<double>() / static_cast<double>(std::max<int64_t>(step_targets, 1));
      }
    }
    if (result.cancelled) {
      adam.zero_grad();  // the partial step is dropped
      break;
    }
    const double lr = options.lr_at(step, total);
    {
      ComputeLock turn;
      adam.step(lr);
      adam.zero_grad();
    }
    result.losses.push_back(step_loss);
    const int64_t done = adam.steps();
    if (!options.checkpoint_path.empty() && options.checkpoint_every > 0 &&
        (done % options.checkpoint_every == 0 || done == total)) {
      save_checkpoint(options.checkpoint_path, params, adam);
    }
    if (on_progress && !on_progress(TrainProgress{done, total, step_loss, lr})) {
      result.cancelled = true;
      break;
    }
  }
  result.steps = adam.steps();
  return result;
}

}  // namespace cartridges
