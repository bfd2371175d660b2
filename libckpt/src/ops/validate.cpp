// SPDX-License-Identifier: Apache-2.0
#include "ckpt/ops/validate.hpp"

#include <algorithm>
#include <limits>
#include <vector>
#include <string>

#include "ckpt/error.hpp"
#include "ckpt/sharding.hpp"
#include "text_helpers.hpp"

namespace ckpt {
namespace {

constexpr std::uint64_t kMaxCount = std::uint64_t{1} << 63;  // element and byte counts stay below, as torch's int64 numel does

}  // namespace

std::optional<std::uint64_t> checked_numel(std::span<const std::int64_t> sizes) noexcept {
  std::uint64_t n = 1;
  for (const std::int64_t s : sizes) {
    if (s < 0 || __builtin_mul_overflow(n, static_cast<std::uint64_t>(s), &n) || n >= kMaxCount) return std::nullopt;
  }
  return n;
}

bool location_in_file(const Checkpoint& c, const ChunkLocation& loc) noexcept {
  const CheckpointFile& f = c.files[loc.file];
  return f.size && loc.offset <= *f.size && loc.length <= *f.size - loc.offset;
}

void index_problems(const Checkpoint& c, const std::function<void(VerifyProblem)>& problem) {
  const std::string root = c.root.string();
  for (const auto& f : c.files) {
    if (!f.size) problem({f.path.string(), std::nullopt, "file is missing (the metadata names it)"});
  }
  auto check_location = [&](const ChunkLocation& loc, const std::string& what) {
    const CheckpointFile& f = c.files[loc.file];
    if (!f.size || location_in_file(c, loc)) return;  // a missing file is reported once, above
    std::uint64_t end = 0;
    const bool wraps = __builtin_add_overflow(loc.offset, loc.length, &end);
    problem({f.path.string(), loc.offset,
             what + " [" + std::to_string(loc.offset) + ", " + (wraps ? "past 2^64" : std::to_string(end)) +
                 ") passes the end of the file (" + std::to_string(*f.size) + " bytes)"});
  };
  for (const TensorEntry& t : c.tensors) {
    const std::optional<std::uint64_t> numel = checked_numel(t.shape);
    std::uint64_t nbytes = 0;
    if (!numel || __builtin_mul_overflow(*numel, element_size(t.dtype), &nbytes) || nbytes >= kMaxCount) {
      problem({root, std::nullopt,
               "tensor '" + t.name + "' has shape " + detail::shape_text(t.shape) +
                   (numel ? ", whose byte count does not fit 63 bits" : ", whose element count is negative or does not fit 63 bits")});
      continue;  // its chunks cannot be checked against it
    }
    // Every element exactly once. Boxes lie inside the tensor (checked on open).
    tiling_problems(
        t.shape, t.chunks,
        [&](std::size_t i, std::size_t k) {
          problem({root, std::nullopt,
                   "chunks of '" + t.name + "' at " + detail::shape_text(t.chunks[i].offsets) + " and " +
                       detail::shape_text(t.chunks[k].offsets) + " overlap"});
        },
        [&](std::optional<std::uint64_t> volume, std::uint64_t n) {
          problem({root, std::nullopt,
                   "chunks of '" + t.name + "' cover " + (volume ? std::to_string(*volume) : std::string("more than 2^64")) + " of its " +
                       std::to_string(n) + " elements" + (volume && *volume < n ? " (a hole)" : "")});
        });
    for (const Chunk& ch : t.chunks) {
      if (!ch.location) {
        problem({root, std::nullopt, "chunk of '" + t.name + "' at " + detail::shape_text(ch.offsets) + " has no storage_data entry"});
        continue;
      }
      check_location(*ch.location, "item of '" + t.name + "'");
    }
  }
  for (const ObjectEntry& o : c.objects) {
    if (o.item) {
      check_location(*o.item, "item of '" + o.name + "'");
    } else if (!o.value) {
      problem({root, std::nullopt, "bytes entry '" + o.name + "' has no storage_data entry"});
    }
  }
}

void require_valid_index(const Checkpoint& c) {
  std::optional<VerifyProblem> first;
  std::size_t count = 0;
  index_problems(c, [&](VerifyProblem p) {
    if (!first) first = std::move(p);
    ++count;
  });
  if (!first) return;
  throw Error(ErrorKind::kFormat, first->source, first->offset,
              first->message + (count > 1 ? " (and " + std::to_string(count - 1) + " more problems; fsdp-ckpt-inspect verify lists them)" : ""));
}

}  // namespace ckpt
