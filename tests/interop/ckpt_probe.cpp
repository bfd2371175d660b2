// SPDX-License-Identifier: Apache-2.0
// ckpt_probe: a test driver that exposes libckpt to the Python interop tests (tests/interop/*.py),
// which hold PyTorch's own reader and writer against ours. Not installed.
//   ckpt_probe dump-torch FILE            JSON: records, storages, tensors with their bytes (hex, C order)
//   ckpt_probe dump-safetensors FILE      JSON: metadata, tensors with their bytes
//   ckpt_probe repickle IN OUT PROTOCOL   parse a pickle and write it back
//   ckpt_probe resave IN OUT LAYOUT NAME  read a torch.save file, write it again (LAYOUT: current|1.13)
//   ckpt_probe write-sample OUT           a torch.save file built with TorchSaveBuilder (see sample.hpp)
//   ckpt_probe write-safetensors-sample OUT
//   ckpt_probe write-dcp DIR WORLD LAYOUT COMPRESSION   a DCP sample with write_dcp (see sample.hpp)
//   ckpt_probe write-load DIR WORLD N COLS ROWS   a DCP of N float32 tensors [WORLD*ROWS, COLS], rank r
//                                         holding rows [r*ROWS, (r+1)*ROWS); the values are made as
//                                         they are written (no tensor is ever in memory), for load tests
//   ckpt_probe dump-checkpoint PATH       JSON: every tensor assembled from its chunks (hex, C order), every object's repr
//   ckpt_probe readers DIR                DIR/.metadata through both readers (NOTE [The direct .metadata
//                                         reader]): exit 0 when the direct one accepts it and builds the
//                                         tree reader's index, 1 when they differ, 3 when it declines
//   ckpt_probe time-reader DIR direct|tree ROUNDS   the median ms of one .metadata reader (bench/metadata)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/io.hpp"
#include "ckpt/open.hpp"
#include "ckpt/pickle.hpp"
#include "formats/dcp/metadata.hpp"
#include "interop/sample.hpp"
#include "ops/elements.hpp"

namespace {

using nlohmann::json;

std::string hex(std::span<const std::byte> b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(b.size() * 2);
  for (std::byte x : b) {
    s += d[static_cast<unsigned>(x) >> 4];
    s += d[static_cast<unsigned>(x) & 15];
  }
  return s;
}

// The elements of a strided view, in C order.
std::vector<std::byte> gather(const ckpt::TorchTensor& t, const ckpt::TorchStorage& s) {
  const std::size_t es = ckpt::element_size(t.dtype);
  std::vector<std::byte> storage = s.data->read_vector(0, s.data->size());
  std::vector<std::byte> out;
  const std::uint64_t n = t.numel();
  std::vector<std::int64_t> idx(t.shape.size(), 0);
  for (std::uint64_t k = 0; k < n; ++k) {
    std::int64_t e = t.storage_offset;
    for (std::size_t d = 0; d < idx.size(); ++d) e += idx[d] * t.stride[d];
    auto at = storage.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(e) * es);
    out.insert(out.end(), at, at + static_cast<std::ptrdiff_t>(es));
    for (std::size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

int dump_torch(const std::string& path) {
  auto f = ckpt::read_torch_save(ckpt::open_file(path));
  json j;
  j["archive_name"] = f.archive_name;
  j["records"] = f.records;
  j["version"] = f.version;
  json storages = json::array();
  for (const auto& s : f.storages) {
    storages.push_back({{"key", s.key}, {"dtype", ckpt::name(s.dtype)}, {"numel", s.numel}, {"location", s.location}});
  }
  j["storages"] = storages;
  json tensors = json::array();
  for (const auto& t : f.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", ckpt::name(t.dtype)},
                       {"shape", t.shape},
                       {"stride", t.stride},
                       {"storage_offset", t.storage_offset},
                       {"storage", f.storages[t.storage].key},
                       {"requires_grad", t.requires_grad},
                       {"is_parameter", t.is_parameter},
                       {"hex", hex(gather(t, f.storages[t.storage]))}});
  }
  j["tensors"] = tensors;
  j["repr"] = ckpt::pickle::repr(*f.root, 1u << 20);
  std::cout << j.dump() << "\n";
  return 0;
}

int dump_safetensors(const std::string& path) {
  auto f = ckpt::read_safetensors(ckpt::open_file(path));
  json j;
  j["header_size"] = f.header_size;
  j["metadata"] = json::object();
  for (const auto& [k, v] : f.metadata) j["metadata"][k] = v;
  json tensors = json::array();
  for (const auto& t : f.tensors) {
    tensors.push_back({{"name", t.name}, {"dtype", ckpt::name(t.dtype)}, {"shape", t.shape}, {"begin", t.begin},
                       {"end", t.end}, {"hex", hex(f.data(t)->read_vector(0, t.end - t.begin))}});
  }
  j["tensors"] = tensors;
  std::cout << j.dump() << "\n";
  return 0;
}

int dump_checkpoint(const std::string& path) {
  const ckpt::Checkpoint c = ckpt::open_checkpoint(path);
  const ckpt::ChunkReader reader(c);
  json j;
  j["format"] = std::string(ckpt::to_string(c.format));
  j["world_size"] = c.world_size ? json(*c.world_size) : json(nullptr);
  j["writer"] = c.writer;
  j["notes"] = c.notes;
  json tensors = json::array();
  for (const auto& t : c.tensors) {
    const std::size_t es = ckpt::element_size(t.dtype);
    std::vector<std::byte> full(t.numel() * es);
    std::vector<bool> covered(t.numel(), false);
    const auto gstride = ckpt::contiguous_strides(t.shape);
    for (const auto& ch : t.chunks) {
      const ckpt::ChunkData d = reader.read(t, ch);
      const auto lstride = ckpt::contiguous_strides(ch.sizes);
      ckpt::detail::for_each_element(d, [&](std::uint64_t i, const std::byte* p) {
        std::uint64_t g = 0, rest = i;
        for (std::size_t k = 0; k < ch.sizes.size(); ++k) {
          const auto idx = rest / static_cast<std::uint64_t>(lstride[k]);
          rest %= static_cast<std::uint64_t>(lstride[k]);
          g += (idx + static_cast<std::uint64_t>(ch.offsets[k])) * static_cast<std::uint64_t>(gstride[k]);
        }
        std::memcpy(full.data() + g * es, p, es);
        covered[g] = true;
      });
    }
    tensors.push_back({{"name", t.name}, {"dtype", ckpt::name(t.dtype)}, {"shape", t.shape}, {"chunks", t.chunks.size()},
                       {"covered", std::count(covered.begin(), covered.end(), true)}, {"hex", hex(full)}});
  }
  j["tensors"] = tensors;
  json objects = json::array();
  for (const auto& o : c.objects) {
    auto v = reader.object_value(o);
    objects.push_back({{"name", o.name}, {"repr", v ? ckpt::pickle::repr(*v, 1u << 16) : ""}});
  }
  j["objects"] = objects;
  j["notes"] = c.notes;
  std::cout << j.dump() << "\n";
  return 0;
}

int repickle(const std::string& in, const std::string& out, int protocol) {
  auto src = ckpt::open_file(in);
  auto bytes = src->read_vector(0, src->size());
  // Kept, not refused: a hostile pickle is carried byte for byte and never executed.
  ckpt::pickle::ParseOptions keep;
  keep.code_globals = ckpt::pickle::CodeGlobals::kKeep;
  auto root = ckpt::pickle::parse(bytes, in, 0, keep);
  auto written = ckpt::pickle::write(*root, protocol);
  auto sink = ckpt::open_file_sink(out, ckpt::Overwrite::kYes);
  sink->write(written);
  sink->commit();
  return 0;
}

int resave(const std::string& in, const std::string& out, const std::string& layout, const std::string& archive) {
  auto f = ckpt::read_torch_save(ckpt::open_file(in));
  ckpt::TorchSaveWriteOptions o;
  o.layout = layout == "1.13" ? ckpt::TorchSaveLayout::kTorch113 : ckpt::TorchSaveLayout::kCurrent;
  o.archive_name = archive;
  auto sink = ckpt::open_file_sink(out, ckpt::Overwrite::kYes);
  ckpt::write_torch_save(
      *sink, *f.root, [&](const std::string& key) { return f.storages[f.storage_index.at(key)].data; }, o);
  sink->commit();
  return 0;
}

// float32 elements made from their index: element e of tensor t is ((e * 2654435761 + t) mod 1000003) / 1024.
class PatternSource final : public ckpt::ByteSource {
 public:
  PatternSource(std::uint64_t tensor, std::uint64_t first, std::uint64_t count)
      : name_("pattern " + std::to_string(tensor)), tensor_(tensor), first_(first), size_(count * 4) {}
  const std::string& name() const noexcept override { return name_; }
  std::uint64_t size() const noexcept override { return size_; }
  void read_at(std::uint64_t offset, std::span<std::byte> out) const override {
    check_range(offset, out.size(), "read");
    for (std::size_t i = 0; i < out.size();) {
      const std::uint64_t at = offset + i, e = first_ + at / 4;
      const auto v = static_cast<float>((e * 2654435761u + tensor_) % 1000003u) / 1024.0f;
      std::byte b[4];
      std::memcpy(b, &v, 4);
      for (std::uint64_t k = at % 4; k < 4 && i < out.size(); ++k) out[i++] = b[k];
    }
  }

 private:
  std::string name_;
  std::uint64_t tensor_, first_, size_;
};

int write_load(const std::string& dir, int world, std::int64_t n, std::int64_t cols, std::int64_t rows) {
  std::vector<ckpt::DcpWriteTensor> tensors;
  tensors.reserve(static_cast<std::size_t>(n));
  for (std::int64_t t = 0; t < n; ++t) {
    ckpt::DcpWriteTensor w{"model.layers." + std::to_string(t / 10) + ".w" + std::to_string(t % 10), ckpt::DType::kFloat32,
                           {world * rows, cols}, {}, false};
    for (int r = 0; r < world; ++r) {
      const auto first = static_cast<std::uint64_t>(r * rows * cols);
      w.chunks.push_back({r, {r * rows, 0}, {rows, cols},
                          std::make_shared<PatternSource>(static_cast<std::uint64_t>(t), first, static_cast<std::uint64_t>(rows * cols))});
    }
    tensors.push_back(std::move(w));
  }
  ckpt::DcpWriteOptions o;
  o.world_size = world;
  o.overwrite = ckpt::Overwrite::kYes;
  ckpt::write_dcp(dir, tensors, {}, o);
  return 0;
}

int readers(const std::filesystem::path& dir) {
  const auto src = ckpt::open_mmap(dir / ".metadata");
  const auto bytes = src->read_vector(0, src->size());
  ckpt::Checkpoint direct;
  direct.root = dir;
  direct.format = ckpt::Format::kDcp;
  ckpt::Checkpoint tree = direct;
  ckpt::detail::DirectReadStats stats;
  if (!ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", direct, {}, &stats)) {
    std::cout << "direct reader declined " << dir.string() << "\n";
    return 3;
  }
  ckpt::detail::read_dcp_metadata_tree(bytes, ".metadata", tree);
  if (const std::string d = ckpt::detail::index_difference(direct, tree); !d.empty()) {
    std::cout << "the readers differ on " << dir.string() << ": " << d << "\n";
    return 1;
  }
  std::cout << "both readers: " << tree.tensors.size() << " tensors, " << tree.objects.size() << " objects, the same index ("
            << stats.chunks_at_a_glance << " chunks read at a glance, " << stats.chunks_by_opcode << " by opcode; "
            << stats.objects_at_a_glance << " storage objects at a glance; the memo guessed below index " << stats.guessed_below << ", "
            << stats.guessed << " tokens kept" << (stats.reguessed ? ", guessed wrong and read again" : "") << "; "
            << stats.batches_beside << " of " << stats.batches << " batches built beside)\n";
  return 0;
}

// Reads DIR/.metadata `rounds` times with one reader (bench/metadata) and prints the median wall
// time in ms; the process's peak RSS is the reader's (GNU time measures it from outside).
int time_reader(const std::filesystem::path& dir, const std::string& which, int rounds) {
  const auto src = ckpt::open_mmap(dir / ".metadata");
  const auto bytes = src->read_vector(0, src->size());
  std::vector<double> ms;
  for (int i = 0; i < rounds; ++i) {
    ckpt::Checkpoint c;
    c.root = dir;
    c.format = ckpt::Format::kDcp;
    const auto t0 = std::chrono::steady_clock::now();
    if (which == "direct") {
      if (!ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", c)) {
        std::cout << "direct reader declined " << dir.string() << "\n";
        return 3;
      }
    } else {
      ckpt::detail::read_dcp_metadata_tree(bytes, ".metadata", c);
    }
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::cout << ms[ms.size() / 2] << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "dump-torch" && argc == 3) return dump_torch(argv[2]);
    if (cmd == "dump-safetensors" && argc == 3) return dump_safetensors(argv[2]);
    if (cmd == "dump-checkpoint" && argc == 3) return dump_checkpoint(argv[2]);
    if (cmd == "readers" && argc == 3) return readers(argv[2]);
    if (cmd == "time-reader" && argc == 5) return time_reader(argv[2], argv[3], std::stoi(argv[4]));
    if (cmd == "write-dcp" && argc == 6) {
      fsdp_test::write_sample_dcp(argv[2], std::stoi(argv[3]), argv[4], argv[5]);
      return 0;
    }
    if (cmd == "write-load" && argc == 7) {
      return write_load(argv[2], std::stoi(argv[3]), std::stoll(argv[4]), std::stoll(argv[5]), std::stoll(argv[6]));
    }
    if (cmd == "repickle" && argc == 5) return repickle(argv[2], argv[3], std::stoi(argv[4]));
    if (cmd == "resave" && argc == 6) return resave(argv[2], argv[3], argv[4], argv[5]);
    if (cmd == "write-sample" && argc == 3) {
      auto sink = ckpt::open_file_sink(argv[2], ckpt::Overwrite::kYes);
      fsdp_test::write_sample_torch_save(*sink);
      sink->commit();
      return 0;
    }
    if (cmd == "write-safetensors-sample" && argc == 3) {
      auto sink = ckpt::open_file_sink(argv[2], ckpt::Overwrite::kYes);
      fsdp_test::write_sample_safetensors(*sink);
      sink->commit();
      return 0;
    }
    std::cerr << "usage: see the comment at the top of tests/interop/ckpt_probe.cpp\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "ckpt_probe: error: " << e.what() << "\n";
    return 1;
  }
}
