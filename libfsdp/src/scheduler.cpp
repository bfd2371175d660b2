// SPDX-License-Identifier: Apache-2.0
#include "fsdp/scheduler.hpp"

#include <string>
#include <utility>

#include "fsdp/error.hpp"
#include "fsdp/optim.hpp"

namespace fsdp {
namespace pk = ckpt::pickle;

namespace {

pk::ValuePtr floats(const std::vector<double>& v) {
  std::vector<pk::ValuePtr> out;
  for (double x : v) out.push_back(pk::make_float(x));
  return pk::make_list(std::move(out));
}

/// A saved list of one number per group; nullopt when `value` is null.
std::optional<std::vector<double>> per_group(const pk::Value* value, std::size_t groups, const char* key) {
  if (!value) return std::nullopt;
  const auto* items = value->sequence();
  if (!items || items->size() != groups) {
    throw Error(std::string("the scheduler's state: '") + key + "' is " + value->type_name() + (items ? " of " + std::to_string(items->size()) : std::string()) +
                ", not a list of one number for each of the optimizer's " + std::to_string(groups) + " param groups");
  }
  std::vector<double> out;
  for (const pk::ValuePtr& x : *items) {
    const auto v = pk::number_value(x.get());
    if (!v) throw Error(std::string("the scheduler's state: '") + key + "' holds a " + x->type_name() + ", not a number");
    out.push_back(*v);
  }
  return out;
}

}  // namespace

LambdaLR::LambdaLR(ShardedOptimizer& optimizer, std::function<double(std::int64_t)> factor) : optimizer_(optimizer), factor_(std::move(factor)) {
  if (!factor_) throw Error("LambdaLR needs a factor function");
  for (const ShardedOptimizer::Group& g : optimizer_.groups()) base_lrs_.push_back(g.initial_lr);
  step();  // torch's _initial_step: epoch 0
}

void LambdaLR::step() {
  ++step_count_;
  ++last_epoch_;
  const double f = factor_(last_epoch_);
  last_lr_.clear();
  for (double base : base_lrs_) last_lr_.push_back(base * f);
  optimizer_.set_lrs(last_lr_);
}

void LambdaLR::go_to(std::int64_t epoch) {
  last_epoch_ = epoch - 1;
  step_count_ = epoch;
  step();
}

pk::ValuePtr LambdaLR::state_dict() const {
  std::vector<pk::ValuePtr> lambdas(base_lrs_.size(), pk::make_none());
  return pk::make_dict({{pk::make_str("base_lrs"), floats(base_lrs_)},
                        {pk::make_str("last_epoch"), pk::make_int(last_epoch_)},
                        {pk::make_str("verbose"), pk::make_bool(false)},
                        {pk::make_str("_step_count"), pk::make_int(step_count_)},
                        {pk::make_str("_get_lr_called_within_step"), pk::make_bool(false)},
                        {pk::make_str("_last_lr"), floats(last_lr_)},
                        {pk::make_str("lr_lambdas"), pk::make_list(std::move(lambdas))}});
}

void LambdaLR::load_state_dict(const pk::ValuePtr& state) {
  if (!state || !state->dict_items()) throw Error("the scheduler's state is " + (state ? state->type_name() : std::string("missing")) + ", not a dict");
  const pk::ValuePtr epoch = pk::dict_value(state.get(), "last_epoch");
  if (!epoch || !epoch->int64()) throw Error("the scheduler's state has no int 'last_epoch'");
  const std::size_t groups = base_lrs_.size();
  const auto base = per_group(pk::dict_value(state.get(), "base_lrs").get(), groups, "base_lrs");
  const auto last = per_group(pk::dict_value(state.get(), "_last_lr").get(), groups, "_last_lr");
  const pk::ValuePtr count = pk::dict_value(state.get(), "_step_count");
  last_epoch_ = *epoch->int64();
  step_count_ = count && count->int64() ? *count->int64() : last_epoch_ + 1;
  if (base) base_lrs_ = *base;
  if (last) last_lr_ = *last;
}

}  // namespace fsdp
