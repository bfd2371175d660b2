// SPDX-License-Identifier: Apache-2.0
// What both kinds of sharded model choose units and checkpointed modules by (WrapPolicy).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <set>
#include <string>
#include <string_view>

namespace fsdp::detail {

inline std::int64_t numel_of(const torch::nn::Module& m) {
  std::int64_t n = 0;
  for (const auto& p : m.parameters(true)) n += p.numel();
  return n;
}

/// WrapPolicy::module_types: the type name ("ns::BlockImpl") whole, without its namespace, or also
/// without a trailing "Impl".
inline bool type_named(const std::set<std::string>& types, const std::string& whole) {
  if (types.empty()) return false;
  std::string_view bare(whole);
  if (const auto at = bare.rfind("::"); at != std::string_view::npos) bare.remove_prefix(at + 2);
  std::string_view holder = bare;
  if (holder.size() > 4 && holder.substr(holder.size() - 4) == "Impl") holder.remove_suffix(4);
  return types.count(whole) > 0 || types.count(std::string(bare)) > 0 || types.count(std::string(holder)) > 0;
}

}  // namespace fsdp::detail
