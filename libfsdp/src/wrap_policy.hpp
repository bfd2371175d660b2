// SPDX-License-Identifier: Apache-2.0
// What both kinds of sharded model choose units and checkpointed modules by (WrapPolicy).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "fsdp/fully_sharded.hpp"

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

/// Whether the policy chooses modules by path or type name (else by size, or not at all).
inline bool by_module(const WrapPolicy& p) { return p.min_num_params <= 0 && (p.own_unit || !p.module_types.empty()); }

/// Whether the policy's path or type names accept the module at `path` of type `type_name`.
inline bool accepts(const WrapPolicy& p, const std::string& path, const std::string& type_name) {
  return (p.own_unit && p.own_unit(path)) || type_named(p.module_types, type_name);
}

}  // namespace fsdp::detail
