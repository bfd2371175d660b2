// SPDX-License-Identifier: Apache-2.0
#include "ops/assemble.hpp"

#include <cstring>
#include <memory>

#include "ckpt/cast.hpp"
#include "ckpt/error.hpp"
#include "text_helpers.hpp"

namespace ckpt::detail {
namespace {

bool c_contiguous(const ChunkData& d) {
  std::int64_t expect = 1;
  for (std::size_t i = d.shape.size(); i-- > 0;) {
    if (d.shape[i] != 1 && d.strides[i] != expect) return false;
    expect *= d.shape[i];
  }
  return true;
}

// One chunk that meets the box: its data, resolved now, or (compressed items) when used.
struct Piece {
  const Chunk* chunk;
  Box overlap;
  std::shared_ptr<const ChunkData> data;  // null: read when the task runs
};

std::shared_ptr<const ChunkData> resolve(const ChunkReader& reader, const TensorEntry& t, const Piece& p) {
  if (p.data) return p.data;
  return std::make_shared<const ChunkData>(reader.read(t, *p.chunk));
}

// Copies box `sub` (absolute) from chunk data `d` (whose box starts at `origin`) into `band`
// (elements of the same dtype, C order, box `band_box`).
void gather(const ChunkData& d, const std::vector<std::int64_t>& origin, const Box& sub, const Box& band_box, std::byte* band,
            std::vector<std::byte>& scratch) {
  const std::size_t es = element_size(d.dtype);
  const std::size_t n = sub.sizes.size();
  // The source span that covers the sub-box, read in one piece.
  std::int64_t first = d.storage_offset, last = d.storage_offset;
  for (std::size_t i = 0; i < n; ++i) {
    first += (sub.offsets[i] - origin[i]) * d.strides[i];
    last += (sub.offsets[i] - origin[i] + sub.sizes[i] - 1) * d.strides[i];
  }
  const std::size_t span = static_cast<std::size_t>(last - first + 1) * es;
  if (scratch.size() < span) scratch.resize(span);
  d.storage->read_at(static_cast<std::uint64_t>(first) * es, std::span(scratch.data(), span));
  const std::vector<std::int64_t> bs = contiguous_strides(band_box.sizes);
  std::int64_t dst0 = 0;
  for (std::size_t i = 0; i < n; ++i) dst0 += (sub.offsets[i] - band_box.offsets[i]) * bs[i];
  // Walk every index of the sub-box except the last dimension; copy the last as a run.
  const std::int64_t run = sub.sizes[n - 1];
  const bool unit = d.strides[n - 1] == 1;
  std::vector<std::int64_t> idx(n, 0);
  for (;;) {
    std::int64_t src = 0, dst = dst0;
    for (std::size_t i = 0; i + 1 < n; ++i) {
      src += idx[i] * d.strides[i];
      dst += idx[i] * bs[i];
    }
    const std::byte* from = scratch.data() + static_cast<std::size_t>(src) * es;
    std::byte* to = band + static_cast<std::size_t>(dst) * es;
    if (unit) {
      std::memcpy(to, from, static_cast<std::size_t>(run) * es);
    } else {
      const auto step = static_cast<std::size_t>(d.strides[n - 1]) * es;
      for (std::size_t k = 0; k < static_cast<std::size_t>(run); ++k) std::memcpy(to + k * es, from + k * step, es);
    }
    std::size_t i = n - 1;
    while (i-- > 0) {
      if (++idx[i] < sub.sizes[i]) break;
      idx[i] = 0;
    }
    if (i == static_cast<std::size_t>(-1)) break;
  }
}

}  // namespace

Box whole(const TensorEntry& tensor) { return {std::vector<std::int64_t>(tensor.shape.size(), 0), tensor.shape}; }

void add_box_tasks(std::vector<CopyTask>& tasks, const ChunkReader& reader, const TensorEntry& t, const Box& dest, DType out,
                   std::uint64_t base, std::size_t group, std::uint64_t max_task, std::uint64_t max_memory, const TaskChecks& checks) {
  CastLedger* const ledger = checks.casts;
  PassingCrcs* const crcs = checks.crcs;
  const DType in = t.dtype;
  const std::uint64_t ies = element_size(in), oes = element_size(out);
  if (in != out && (!is_castable_float(in) || !is_castable_float(out))) internal_error("add_box_tasks: not a float cast");
  const std::uint64_t volume = box_volume(dest.sizes);
  if (volume == 0) return;

  // The chunks that meet the box, checked to tile it exactly.
  std::vector<Piece> pieces;
  std::vector<Box> boxes;
  for (const Chunk& c : t.chunks) {
    if (box_volume(c.sizes) == 0) continue;  // zero-size chunks hold nothing (docs/formats/sharding.md#zero-size-chunks)
    std::optional<Box> o = dest.sizes.empty() ? std::optional<Box>(Box{}) : intersect(c.offsets, c.sizes, dest.offsets, dest.sizes);
    if (!o) continue;
    if (!c.location) {
      throw Error(ErrorKind::kFormat, reader.checkpoint().root.string(), std::nullopt,
                  "chunk of '" + t.name + "' at " + shape_text(c.offsets) + " has no storage_data entry");
    }
    Piece p{&c, *o, nullptr};
    if (c.location->transforms().empty()) {
      p.data = std::make_shared<const ChunkData>(reader.read(t, c));
    } else if (box_volume(c.sizes) * ies > max_memory) {
      throw Error(ErrorKind::kInvalidArgument, reader.checkpoint().root.string(), std::nullopt,
                  "the compressed chunk of '" + t.name + "' at " + shape_text(c.offsets) + " decodes to " +
                      std::to_string(box_volume(c.sizes) * ies) + " bytes, more than the memory bound of " + std::to_string(max_memory) +
                      " (raise --max-memory)");
    }
    boxes.push_back(*o);
    pieces.push_back(std::move(p));
  }
  tiling_problems(
      dest.sizes, boxes,
      [&](std::size_t i, std::size_t k) {
        throw Error(ErrorKind::kFormat, reader.checkpoint().root.string(), std::nullopt,
                    "chunks of '" + t.name + "' at " + shape_text(pieces[i].chunk->offsets) + " and " +
                        shape_text(pieces[k].chunk->offsets) + " overlap");
      },
      [&](std::optional<std::uint64_t> covered, std::uint64_t numel) {
        throw Error(ErrorKind::kFormat, reader.checkpoint().root.string(), std::nullopt,
                    "chunks of '" + t.name + "' cover " + (covered ? std::to_string(*covered) : std::string("more than 2^64")) + " of the " +
                        std::to_string(numel) + " elements to write" + (covered && *covered < numel ? " (a hole)" : ""));
      });

  // Fast path: every overlap a contiguous run in the box and in its chunk's stored elements.
  bool runs = true;
  for (const Piece& p : pieces) {
    runs = runs && is_contiguous_run(p.overlap.sizes, dest.sizes) && is_contiguous_run(p.overlap.sizes, p.chunk->sizes) &&
           (!p.data || c_contiguous(*p.data));
  }
  if (runs) {
    for (const Piece& p : pieces) {
      const std::uint64_t n = box_volume(p.overlap.sizes);
      const std::uint64_t src0 = flat_index(p.overlap.offsets, p.chunk->offsets, p.chunk->sizes);
      const std::uint64_t dst0 = flat_index(p.overlap.offsets, dest.offsets, dest.sizes);
      // A compressed item is decoded whole by its task, so it is one task.
      const std::uint64_t step = p.data ? std::max<std::uint64_t>(1, max_task / std::max(ies, oes)) : n;
      for (std::uint64_t e = 0; e < n; e += step) {
        const std::uint64_t k = std::min(step, n - e);
        tasks.push_back({base + (dst0 + e) * oes, k * oes, group,
                         [&reader, &t, p, in, out, ies, src0, e, ledger, crcs](std::span<std::byte> o, std::vector<std::byte>& scratch) {
                           const auto d = resolve(reader, t, p);
                           const std::uint64_t at = (static_cast<std::uint64_t>(d->storage_offset) + src0 + e) * ies;
                           if (in == out) {
                             d->storage->read_at(at, o);
                             if (crcs) crcs->passed(d->storage, d->crc32, at, o);
                             return;
                           }
                           const std::size_t nb = o.size() / element_size(out) * ies;
                           if (scratch.size() < nb) scratch.resize(nb);
                           d->storage->read_at(at, std::span(scratch.data(), nb));
                           if (crcs) crcs->passed(d->storage, d->crc32, at, std::span(scratch.data(), nb));
                           const CastDamage damage = cast(std::span<const std::byte>(scratch.data(), nb), in, o, out);
                           if (ledger) ledger->record(t.name, damage);
                         }});
      }
    }
    return;
  }

  // Gather: bands of rows along the box's dim 0.
  const std::uint64_t row = volume / static_cast<std::uint64_t>(dest.sizes[0]);
  if (row * (ies + (in != out ? oes : 0)) > max_memory) {
    throw Error(ErrorKind::kInvalidArgument, reader.checkpoint().root.string(), std::nullopt,
                "'" + t.name + "' must be gathered row by row (its chunks are not split on dim 0, or are strided) and one row needs " +
                    std::to_string(row * (ies + (in != out ? oes : 0))) + " bytes, more than the memory bound of " +
                    std::to_string(max_memory) + " (raise --max-memory)");
  }
  const std::int64_t rows = static_cast<std::int64_t>(std::max<std::uint64_t>(1, max_task / (row * std::max(ies, oes))));
  for (std::int64_t r0 = 0; r0 < dest.sizes[0]; r0 += rows) {
    Box band = dest;
    band.offsets[0] = dest.offsets[0] + r0;
    band.sizes[0] = std::min(rows, dest.sizes[0] - r0);
    std::vector<Piece> in_band;
    for (const Piece& p : pieces) {
      if (auto o = intersect(p.overlap.offsets, p.overlap.sizes, band.offsets, band.sizes)) in_band.push_back({p.chunk, *o, p.data});
    }
    const std::uint64_t n = box_volume(band.sizes);
    tasks.push_back({base + static_cast<std::uint64_t>(r0) * row * oes, n * oes, group,
                     [&reader, &t, band, in_band, in, out, ies, ledger, crcs](std::span<std::byte> o, std::vector<std::byte>& scratch) {
                       thread_local std::vector<std::byte> staging;
                       std::byte* dst = o.data();
                       if (in != out) {
                         const std::size_t nb = o.size() / element_size(out) * ies;
                         if (staging.size() < nb) staging.resize(nb);
                         dst = staging.data();
                       }
                       for (const Piece& p : in_band) {
                         const auto d = resolve(reader, t, p);
                         gather(*d, p.chunk->offsets, p.overlap, band, dst, scratch);
                         if (crcs) crcs->read_later(d->storage, d->crc32);  // strided reads: the record is read whole at the end
                       }
                       if (in == out) return;
                       const CastDamage damage = cast(std::span<const std::byte>(staging.data(), o.size() / element_size(out) * ies), in, o, out);
                       if (ledger) ledger->record(t.name, damage);
                     }});
  }
}

}  // namespace ckpt::detail
