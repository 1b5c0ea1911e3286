// The trainable prefix, the training data's checks, and the distillation loss.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "cartridges/cartridge.h"
#include "model/fused_cpu.h"

namespace cartridges {

namespace {

// Cross-entropy of each target's logits z [T, V] against its teacher's top-k (token ids [T, K],
// probabilities p [T, K]): sum_k p_k (lse(z) - z[id_k]). The same value as the log-softmax
// gathered at the ids, without a [T, V] log-softmax kept for the backward: the backward rebuilds
// softmax(z) from the saved log-sum-exp, dz = g (sum_k p_k softmax(z) - p scattered at the ids).
// On the CPU both run as one pass per row over z in its own dtype (model/fused_cpu.h); elsewhere
// rows are taken a block at a time in float32.
struct TopKCrossEntropy : public torch::autograd::Function<TopKCrossEntropy> {
  // Rows per float32 block where the fused CPU loops do not apply: a small block on a CPU (float16
  // weights); on a GPU 1,024 rows of 49,152 words (200 MB), whose few kernel launches cost less
  // than many small ones.
  static int64_t rows_per_block(const at::Tensor& logits) { return logits.device().is_cpu() ? 64 : 1024; }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& ids,
                            const at::Tensor& probs) {
    at::Tensor lse;
    if (ops::fused_cpu_supported(logits)) {
      lse = ops::logsumexp_rows_cpu(logits);
    } else {
      const int64_t T = logits.size(0), block_rows = rows_per_block(logits);
      lse = at::empty({T}, logits.options().dtype(at::kFloat));
      for (int64_t start = 0; start < T; start += block_rows) {
        const int64_t n = std::min(block_rows, T - start);
        lse.narrow(0, start, n).copy_(at::logsumexp(logits.narrow(0, start, n).to(at::kFloat), -1));
      }
    }
    auto picked = logits.gather(1, ids).to(at::kFloat);
    ctx->save_for_backward({logits, ids, probs, lse});
    return probs.sum(1) * lse - (probs * picked).sum(1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &logits = saved[0], &ids = saved[1], &probs = saved[2], &lse = saved[3];
    const auto grad = grads[0].to(at::kFloat);
    const auto mass = grad * probs.sum(1);  // [T]: each row's softmax weight in the gradient
    const auto at_ids = grad.unsqueeze(1) * probs;  // [T, K]: taken away at the ids
    if (ops::fused_cpu_supported(logits)) return {ops::softmax_grad_cpu(logits, lse, mass, ids, at_ids), {}, {}};
    auto out = at::empty_like(logits);
    const int64_t T = logits.size(0), block_rows = rows_per_block(logits);
    for (int64_t start = 0; start < T; start += block_rows) {
      const int64_t n = std::min(block_rows, T - start);
      auto block = logits.narrow(0, start, n).to(at::kFloat).sub_(lse.narrow(0, start, n).unsqueeze(1)).exp_();
      block.mul_(mass.narrow(0, start, n).unsqueeze(1));
      block.scatter_add_(1, ids.narrow(0, start, n), -at_ids.narrow(0, start, n));
      out.narrow(0, start, n).copy_(block);
    }
    return {out, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

CartridgeParams CartridgeParams::from_prefix(const KVPrefix& prefix, int64_t num_frozen) {
  const int64_t P = prefix.num_tokens();
  TORCH_CHECK(!prefix.keys.empty() && prefix.keys.size() == prefix.values.size(),
              "CartridgeParams: the prefix needs keys and values for every layer");
  TORCH_CHECK(num_frozen >= 0 && num_frozen < P, "CartridgeParams: num_frozen must be in [0, ", P, "), got ",
              num_frozen);
  CartridgeParams params;
  auto split = [&](const at::Tensor& t, std::vector<at::Tensor>& frozen, std::vector<at::Tensor>& trainable) {
    TORCH_CHECK(t.dim() == 3 && t.size(1) == P, "CartridgeParams: every layer must be [H_kv, ", P, ", D]");
    auto f32 = t.detach().to(at::kFloat);
    frozen.push_back(f32.narrow(1, 0, num_frozen).clone());
    trainable.push_back(f32.narrow(1, num_frozen, P - num_frozen).clone().set_requires_grad(true));
  };
  for (size_t l = 0; l < prefix.keys.size(); ++l) {
    split(prefix.keys[l], params.frozen_keys, params.trainable_keys);
    split(prefix.values[l], params.frozen_values, params.trainable_values);
  }
  for (const auto& bias : prefix.biases) params.biases.push_back(bias.detach().to(at::kFloat).clone());
  return params;
}

std::vector<at::Tensor> CartridgeParams::parameters() const {
  std::vector<at::Tensor> out(trainable_keys);
  out.insert(out.end(), trainable_values.begin(), trainable_values.end());
  return out;
}

KVPrefix CartridgeParams::to_prefix(at::ScalarType dtype, at::Device device, bool detach) const {
  KVPrefix prefix;
  auto join = [&](const at::Tensor& frozen, const at::Tensor& trainable) {
    auto t = at::cat({frozen.to(trainable.device()), detach ? trainable.detach() : trainable}, 1);
    return t.to(device, dtype).contiguous();
  };
  for (int64_t l = 0; l < num_layers(); ++l) {
    prefix.keys.push_back(join(frozen_keys[l], trainable_keys[l]));
    prefix.values.push_back(join(frozen_values[l], trainable_values[l]));
  }
  for (const auto& bias : biases) prefix.biases.push_back(bias.to(device, at::kFloat).contiguous());
  return prefix;
}

void TrainingData::validate(int64_t vocab_size) const {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, "TrainingData: tokens must be [N, S] int64");
  const int64_t N = tokens.size(0), S = tokens.size(1);
  TORCH_CHECK(N > 0, "TrainingData: no conversations");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == N && lengths.scalar_type() == at::kLong,
              "TrainingData: lengths must be [N] int64");
  TORCH_CHECK(lengths.min().item<int64_t>() >= 2 && lengths.max().item<int64_t>() <= S,
              "TrainingData: lengths must be in [2, S]");
  TORCH_CHECK(target_mask.sizes() == tokens.sizes() && target_mask.scalar_type() == at::kBool,
              "TrainingData: target_mask must be [N, S] bool");
  // A target predicts the next token of the same row, so it lies before the row's last token.
  auto valid = at::arange(S, at::kLong).unsqueeze(0) < (lengths - 1).unsqueeze(1);
  TORCH_CHECK(!(target_mask & ~valid).any().item<bool>(), "TrainingData: targets past a row's last token - 1");
  TORCH_CHECK(target_mask.any(1).all().item<bool>(), "TrainingData: every conversation needs a target");
  const int64_t T = target_mask.sum().item<int64_t>();
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.scalar_type() == at::kLong,
              "TrainingData: topk_ids must be [T, K] int64 with T = ", T, " targets");
  TORCH_CHECK(topk_logprobs.sizes() == topk_ids.sizes() && topk_logprobs.scalar_type() == at::kFloat,
              "TrainingData: topk_logprobs must be float32 shaped like topk_ids");
  TORCH_CHECK(topk_ids.min().item<int64_t>() >= 0 && topk_ids.max().item<int64_t>() < vocab_size,
              "TrainingData: topk_ids outside the vocabulary of ", vocab_size);
  TORCH_CHECK(tokens.min().item<int64_t>() >= 0 && tokens.max().item<int64_t>() < vocab_size,
              "TrainingData: tokens outside the vocabulary of ", vocab_size);
}

at::Tensor distillation_target_losses(const LlamaModel& model, const CartridgeParams& params,
                                      const TrainingData& data, const std::vector<int64_t>& rows,
                                      const PrefixPtr& companion, int64_t companion_every) {
  TORCH_CHECK(!rows.empty(), "distillation loss: no rows");
  TORCH_CHECK(params.num_layers() == model.config().num_layers, "distillation loss: the cartridge has ",
              params.num_layers(), " layers, the model ", model.config().num_layers);
  const int64_t B = static_cast<int64_t>(rows.size());
  // Where each row's targets start in topk_ids (targets are stored in row-major mask order).
  auto counts = data.target_mask.sum(1);            // [N]
  auto starts = counts.cumsum(0) - counts;          // [N]
  auto counts_a = counts.accessor<int64_t, 1>();
  auto starts_a = starts.accessor<int64_t, 1>();
  std::vector<int64_t> lengths(B), target_rows;
  int64_t S = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t r = rows[i];
    TORCH_CHECK(r >= 0 && r < data.size(), "distillation loss: row ", r, " out of range");
    lengths[i] = data.lengths[r].item<int64_t>();
    S = std::max(S, lengths[i]);
    for (int64_t t = 0; t < counts_a[r]; ++t) target_rows.push_back(starts_a[r] + t);
  }
  auto index = at::tensor(rows, at::kLong);
  auto tokens = data.tokens.index_select(0, index).narrow(1, 0, S);      // [B, S]
  auto mask = data.target_mask.index_select(0, index).narrow(1, 0, S);   // [B, S]
  auto targets = at::tensor(target_rows, at::kLong);
  const auto device = model.device();
  auto ids = data.topk_ids.index_select(0, targets).to(device);            // [T, K]
  auto teacher = data.topk_logprobs.index_select(0, targets).to(device);  // [T, K]

  PrefixPtr prefix = std::make_shared<KVPrefix>(params.to_prefix(model.dtype(), device, /*detach=*/false));
  std::vector<PrefixList> prefixes(B, PrefixList{prefix});
  if (companion && companion_every > 0) {
    for (int64_t i = 0; i < B; ++i) {
      if (rows[i] % companion_every == 0) prefixes[i] = PrefixList{companion, prefix};
    }
  }
  ForwardBatch batch{tokens, lengths, std::move(prefixes)};
  auto hidden = model.forward_hidden(batch, nullptr);                      // [B, S, hidden]
  // Only target positions reach the lm_head: the vocabulary is large.
  return TopKCrossEntropy::apply(model.logits_in_model_dtype(hidden.index({mask.to(device)})), ids, teacher.exp());
}

std::pair<at::Tensor, int64_t> distillation_loss_sum(const LlamaModel& model, const CartridgeParams& params,
                                                     const TrainingData& data, const std::vector<int64_t>& rows,
                                                     const PrefixPtr& companion, int64_t companion_every) {
  auto losses = distillation_target_losses(model, params, data, rows, companion, companion_every);
  return {losses.sum(), losses.size(0)};
}

}  // namespace cartridges
