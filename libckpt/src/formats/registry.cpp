// SPDX-License-Identifier: Apache-2.0
// The registry of format drivers: detect_format() and open_checkpoint() walk it. Adding a format
// is its driver (formats/<name>/) and one line below (and its Format value in ckpt/format.hpp).
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "ckpt/error.hpp"
#include "ckpt/format.hpp"
#include "ckpt/open.hpp"
#include "formats/driver.hpp"

namespace ckpt {
namespace formats {

std::span<const Driver* const> drivers() {
  // A file's drivers look at its signature; order matters only where one could be mistaken for
  // another (an index is plain JSON, so it is asked last; a DCP directory before a folder).
  // DCP's Hugging Face storage is asked after the folder, which reads such files through their
  // index when there is one.
  static constexpr std::array<const Driver*, 7> kDrivers = {
      &kDcpDriver,         &kHuggingFaceFolderDriver, &kDcpSafetensorsDriver,    &kTorchSaveDriver,
      &kSafetensorsDriver, &kHdf5Driver,              &kHuggingFaceIndexDriver,
  };
  return kDrivers;
}

}  // namespace formats

std::string_view to_string(Format format) noexcept {
  switch (format) {
    case Format::kTorchSave: return "torch-save";
    case Format::kTorchSaveIndex: return "torch-save-index";
    case Format::kSafetensors: return "safetensors";
    case Format::kSafetensorsIndex: return "safetensors-index";
    case Format::kDcp: return "dcp";
    case Format::kLightningSharded: return "lightning-sharded";
    case Format::kDcpSafetensors: return "dcp-safetensors";
    case Format::kHdf5: return "hdf5";
    case Format::kUnknown: return "unknown";
  }
  return "unknown";
}

namespace {

// Runs `f` with the probe of `path`: a directory, or a file opened with its first bytes read.
template <class F>
auto with_probe(const std::filesystem::path& path, F&& f) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return f(formats::Probe{path, true, nullptr, {}});
  SourcePtr src = open_file(path);
  const auto head = src->read_vector(0, std::min<std::uint64_t>(src->size(), formats::kHeadBytes));
  return f(formats::Probe{path, false, src.get(), head});
}

std::pair<Format, const formats::Driver*> detect(const formats::Probe& probe) {
  for (const formats::Driver* d : formats::drivers()) {
    if (const Format f = d->detect(probe); f != Format::kUnknown) return {f, d};
  }
  return {Format::kUnknown, nullptr};
}

// For a directory that is not a checkpoint: the checkpoints it holds, one or two levels down (a
// run's step-N folders; accelerate's checkpoint-N/pytorch_model_fsdp_0), named with the newest
// (the last written); empty when it holds none.
std::string checkpoints_inside(const std::filesystem::path& dir) {
  constexpr std::size_t kMaxLooked = 10000, kNamed = 8;
  std::vector<std::pair<std::filesystem::file_time_type, std::string>> found;
  std::size_t looked = 0;
  std::error_code ec;
  auto look = [&](const std::filesystem::path& at, int depth, const auto& self) -> void {
    for (const auto& e : std::filesystem::directory_iterator(at, ec)) {
      if (++looked > kMaxLooked) return;
      try {
        const bool found_one = with_probe(e.path(), [](const formats::Probe& p) { return detect(p).first != Format::kUnknown; });
        if (found_one) {
          found.emplace_back(std::filesystem::last_write_time(e.path(), ec), std::filesystem::relative(e.path(), dir, ec).string());
        } else if (depth < 2 && e.is_directory(ec)) {
          self(e.path(), depth + 1, self);
        }
      } catch (const Error&) {
        // an entry that cannot be read is no checkpoint
      }
    }
  };
  look(dir, 1, look);
  if (found.empty()) return {};
  std::sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
  const auto newest = std::max_element(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  std::string names;
  for (std::size_t i = 0; i < found.size() && i < kNamed; ++i) names += (i ? ", " : "") + found[i].second;
  if (found.size() > kNamed) names += ", and " + std::to_string(found.size() - kNamed) + " more";
  return "directory is not a checkpoint but holds " + std::to_string(found.size()) + (found.size() == 1 ? " checkpoint (" : " checkpoints (") +
         names + "); the newest is " + newest->second + ": pass one of them";
}

}  // namespace

Format detect_format(const std::filesystem::path& path) {
  return with_probe(path, [](const formats::Probe& p) { return detect(p).first; });
}

Checkpoint open_checkpoint(const std::filesystem::path& given, MetaTrees trees) {
  // "dir/" is "dir": a trailing separator would leave the checkpoint's root without a name
  // (what a merge records as its source, what errors name).
  std::filesystem::path path = given;
  while (!path.has_filename() && path.has_parent_path() && path != path.root_path()) path = path.parent_path();
  const formats::Driver* driver = with_probe(path, [&](const formats::Probe& p) {
    const auto [format, d] = detect(p);
    if (d) return d;
    // What it is instead: nearly a format (a driver says what is missing), or a folder of
    // checkpoints; else what is recognised.
    for (const formats::Driver* other : formats::drivers()) {
      if (!other->near_miss) continue;
      if (std::string why = other->near_miss(p); !why.empty()) {
        throw Error(ErrorKind::kFormat, path.string(), std::nullopt, why);
      }
    }
    if (p.directory) {
      if (std::string inside = checkpoints_inside(path); !inside.empty()) throw Error(ErrorKind::kFormat, path.string(), std::nullopt, inside);
    }
    std::string names;
    for (const formats::Driver* other : formats::drivers()) names += (names.empty() ? "" : ", ") + std::string(other->name);
    throw Error(ErrorKind::kFormat, path.string(), p.directory ? std::nullopt : std::optional<std::uint64_t>(0),
                std::string(p.directory ? "directory" : "file") + " is not a checkpoint this tool recognises (" + names + ")" +
                    (p.directory ? ", nor holds one" : ""));
  });
  return driver->open(path, trees);
}

}  // namespace ckpt
