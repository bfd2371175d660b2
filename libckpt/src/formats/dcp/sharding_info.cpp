// SPDX-License-Identifier: Apache-2.0
#include "formats/dcp/sharding_info.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/error.hpp"

namespace ckpt::detail {
namespace {

constexpr std::string_view kShardingInfo = "DCP_SHARDING_INFO";

}  // namespace

std::optional<std::vector<std::vector<std::int64_t>>> dcp_saved_offsets(const SafetensorsFile& f) {
  const std::string& name = f.source->name();
  std::vector<std::vector<std::int64_t>> out;
  const auto info = std::find_if(f.metadata.begin(), f.metadata.end(), [](const auto& kv) { return kv.first == kShardingInfo; });
  if (info == f.metadata.end()) return std::nullopt;
  auto fail = [&](const std::string& what) { throw Error(ErrorKind::kFormat, name, 8, "__metadata__ " + std::string(kShardingInfo) + " " + what); };
  const nlohmann::json j = nlohmann::json::parse(info->second, nullptr, false);
  if (!j.is_object()) fail("is not a JSON object");
  for (const SafetensorsTensor& t : f.tensors) {
    const auto it = j.find(t.name);
    if (it == j.end()) fail("has no entry for tensor '" + t.name + "'");
    const auto at = it->is_object() ? it->find("saved_offsets") : it->end();
    if (!it->is_object() || at == it->end() || !at->is_array() || at->size() != t.shape.size()) {
      fail("entry of '" + t.name + "' has no saved_offsets of " + std::to_string(t.shape.size()) + " ints");
    }
    std::vector<std::int64_t> offsets;
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      const auto& o = (*at)[d];
      if (!o.is_number_unsigned() || o.get<std::uint64_t>() > (std::uint64_t{1} << 62) - t.shape[d]) {
        fail("entry of '" + t.name + "' has saved offset " + o.dump() + ", not an int in [0, 2^62 - size)");
      }
      offsets.push_back(o.get<std::int64_t>());
    }
    out.push_back(std::move(offsets));
  }
  return out;
}

}  // namespace ckpt::detail
