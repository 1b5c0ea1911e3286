// Adam, step for step as torch.optim.Adam (default options) computes it.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>

#include "cartridges/cartridge.h"

namespace cartridges {

Adam::Adam(std::vector<at::Tensor> params, AdamOptions options, std::vector<double> lr_scales,
           std::vector<at::Tensor> channel_scales)
    : params_(std::move(params)),
      options_(options),
      lr_scales_(std::move(lr_scales)),
      channel_scales_(std::move(channel_scales)) {
  if (lr_scales_.empty()) lr_scales_.assign(params_.size(), 1.0);
  TORCH_CHECK(lr_scales_.size() == params_.size(), "Adam: ", lr_scales_.size(), " lr scales for ", params_.size(),
              " parameters");
  for (double s : lr_scales_) TORCH_CHECK(std::isfinite(s) && s >= 0, "Adam: lr scales must be finite and >= 0");
  TORCH_CHECK(channel_scales_.empty() || channel_scales_.size() == params_.size(), "Adam: ", channel_scales_.size(),
              " channel scales for ", params_.size(), " parameters");
  for (size_t i = 0; i < channel_scales_.size(); ++i) {
    auto& c = channel_scales_[i];
    bool broadcasts = c.dim() == params_[i].dim();
    for (int64_t d = 0; broadcasts && d < c.dim(); ++d) {
      broadcasts = c.size(d) == 1 || c.size(d) == params_[i].size(d);
    }
    TORCH_CHECK(broadcasts, "Adam: channel scale ", i, " of shape ", c.sizes(),
                " does not broadcast to its parameter's ", params_[i].sizes());
    TORCH_CHECK(c.isfinite().all().item<bool>() && (c >= 0).all().item<bool>(),
                "Adam: channel scales must be finite and >= 0");
    c = c.detach().to(params_[i].options());
  }
  for (const auto& p : params_) {
    TORCH_CHECK(p.scalar_type() == at::kFloat, "Adam: parameters must be float32 master copies");
    exp_avg_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    exp_avg_sq_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    if (options_.anchor > 0) anchors_.push_back(p.detach().clone());
  }
}

void Adam::step(double lr) {
  at::NoGradGuard no_grad;
  ++step_;
  const double bias1 = 1.0 - std::pow(options_.beta1, static_cast<double>(step_));
  const double bias2 = 1.0 - std::pow(options_.beta2, static_cast<double>(step_));
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& grad = params_[i].grad();
    if (!grad.defined()) continue;
    exp_avg_[i].lerp_(grad, 1.0 - options_.beta1);
    exp_avg_sq_[i].mul_(options_.beta2).addcmul_(grad, grad, 1.0 - options_.beta2);
    auto denom = (exp_avg_sq_[i].sqrt() / std::sqrt(bias2)).add_(options_.eps);
    const double lr_i = lr * lr_scales_[i];
    if (channel_scales_.empty()) {
      params_[i].addcdiv_(exp_avg_[i], denom, -lr_i / bias1);
      if (options_.anchor > 0) params_[i].lerp_(anchors_[i], lr_i * options_.anchor);
    } else {
      params_[i].addcdiv_(exp_avg_[i] * channel_scales_[i], denom, -lr_i / bias1);
      if (options_.anchor > 0) params_[i].lerp_(anchors_[i], channel_scales_[i] * (lr_i * options_.anchor));
    }
  }
}

void Adam::zero_grad() {
  for (auto& p : params_) {
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
  }
}

void Adam::load_state(int64_t steps, const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq) {
  TORCH_CHECK(exp_avg.size() == params_.size() && exp_avg_sq.size() == params_.size(),
              "Adam::load_state: expected state for ", params_.size(), " parameters");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(exp_avg[i].sizes() == params_[i].sizes() && exp_avg_sq[i].sizes() == params_[i].sizes(),
                "Adam::load_state: state ", i, " has the wrong shape");
    exp_avg_[i].copy_(exp_avg[i]);
    exp_avg_sq_[i].copy_(exp_avg_sq[i]);
  }
  step_ = steps;
}

}  // namespace cartridges
