// SPDX-License-Identifier: Apache-2.0
// Benchmarks for libckpt's byte layer. Each prints its own time and a ratio against a baseline
// measured in the same run (the machine is shared and noisy; absolute numbers alone mislead).
//   bench_ckpt crc [MiB]                CRC-32 (libdeflate) vs zlib's crc32, one thread
//   bench_ckpt write DIR [MiB]          torch.save of MiB of tensors (fsync included) vs cp + fsync
//   bench_ckpt make-many FILE [N]       writes a torch.save file with N small tensors
//   bench_ckpt open FILE [repeats]      open + list tensors; prints the median in ms
//   bench_ckpt parse FILE               time of parsing a pickle alone, freeing it, and open_checkpoint
//                                       of its directory (where the time of a DCP summary goes)
//   bench_ckpt make-dcp DIR RANKS N     a DCP directory (torch 1.13 layout, so torch 1.13 reads it too)
//                                       of N small tensors chunked over RANKS ranks
#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/io.hpp"
#include "ckpt/open.hpp"
#include "ckpt/pickle.hpp"
#include "zip/crc32.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int crc(std::size_t mib) {
  std::vector<std::byte> buf(mib << 20);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<std::byte>(i * 2654435761u >> 13);
  double best_ours = 1e9, best_zlib = 1e9;
  std::uint32_t a = 0, b = 0;
  for (int r = 0; r < 5; ++r) {
    auto t = Clock::now();
    a = ckpt::detail::crc32_update(0, buf);
    best_ours = std::min(best_ours, seconds_since(t));
    t = Clock::now();
    b = static_cast<std::uint32_t>(::crc32_z(0, reinterpret_cast<const Bytef*>(buf.data()), buf.size()));
    best_zlib = std::min(best_zlib, seconds_since(t));
  }
  if (a != b) {
    std::fprintf(stderr, "crc mismatch\n");
    return 1;
  }
  const double gb = static_cast<double>(buf.size()) / 1e9;
  std::printf("crc32: %.2f GB/s (libdeflate), zlib %.2f GB/s in the same run: ratio %.2fx\n", gb / best_ours, gb / best_zlib,
              best_zlib / best_ours);
  return 0;
}

int write(const std::filesystem::path& dir, std::size_t mib) {
  // 64 tensors of mib/64 MiB each, held in memory, as a training step would hand them over.
  const std::size_t n = 64, each = (mib << 20) / n;
  std::vector<std::vector<std::byte>> data(n, std::vector<std::byte>(each));
  for (std::size_t k = 0; k < n; ++k)
    for (std::size_t i = 0; i < each; i += 4096) data[k][i] = static_cast<std::byte>(k + i);
  ckpt::TorchSaveBuilder b;
  std::vector<std::pair<ckpt::pickle::ValuePtr, ckpt::pickle::ValuePtr>> items;
  for (std::size_t k = 0; k < n; ++k) {
    auto s = b.add_storage(ckpt::DType::kFloat32, ckpt::borrowed_source(data[k]));
    items.emplace_back(ckpt::pickle::make_str("layer." + std::to_string(k) + ".weight"),
                       b.tensor(s, {static_cast<std::int64_t>(each / 4)}));
  }
  auto root = ckpt::pickle::make_ordered_dict(std::move(items));
  const auto ours = dir / "bench-ours.pt";
  std::filesystem::remove(ours);
  auto t = Clock::now();
  {
    auto sink = ckpt::open_file_sink(ours, ckpt::Overwrite::kYes);
    b.write(*sink, *root);
    sink->commit();
  }
  const double t_ours = seconds_since(t);
  // Baseline: cp of a file of the same size (hot in the page cache, as ours was in memory), then fsync.
  const auto src = dir / "bench-src.bin", dst = dir / "bench-cp.bin";
  std::filesystem::copy_file(ours, src, std::filesystem::copy_options::overwrite_existing);
  std::system(("sync " + src.string()).c_str());
  std::filesystem::remove(dst);
  t = Clock::now();
  const std::string cmd = "cp " + src.string() + " " + dst.string() + " && sync " + dst.string();
  if (std::system(cmd.c_str()) != 0) return 1;
  const double t_cp = seconds_since(t);
  const double mb = static_cast<double>(std::filesystem::file_size(ours)) / 1e6;
  std::printf("torch.save write of %zu MiB: ours %.3f s (%.0f MB/s, fsync included); cp + fsync %.3f s: ratio %.2fx\n", mib, t_ours,
              mb / t_ours, t_cp, t_ours / t_cp);
  std::filesystem::remove(ours);
  std::filesystem::remove(src);
  std::filesystem::remove(dst);
  return 0;
}

int make_many(const std::filesystem::path& file, std::size_t n) {
  ckpt::TorchSaveBuilder b;
  std::vector<std::pair<ckpt::pickle::ValuePtr, ckpt::pickle::ValuePtr>> items;
  for (std::size_t k = 0; k < n; ++k) {
    auto s = b.add_storage(ckpt::DType::kFloat32, ckpt::memory_source(std::vector<std::byte>(64)));
    items.emplace_back(ckpt::pickle::make_str("layers." + std::to_string(k / 10) + ".w" + std::to_string(k % 10)), b.tensor(s, {4, 4}));
  }
  auto sink = ckpt::open_file_sink(file, ckpt::Overwrite::kYes);
  b.write(*sink, *ckpt::pickle::make_ordered_dict(std::move(items)));
  sink->commit();
  return 0;
}

int open_list(const std::filesystem::path& file, int repeats) {
  std::vector<double> times;
  std::size_t tensors = 0;
  for (int r = 0; r < repeats; ++r) {
    auto t = Clock::now();
    auto f = ckpt::read_torch_save(ckpt::open_mmap(file));
    tensors = f.tensors.size();
    times.push_back(seconds_since(t));
  }
  std::sort(times.begin(), times.end());
  std::printf("%.3f\n", times[times.size() / 2] * 1e3);
  std::fprintf(stderr, "open+list of %zu tensors: median %.3f ms over %d runs\n", tensors, times[times.size() / 2] * 1e3, repeats);
  return 0;
}

int make_dcp(const std::filesystem::path& dir, int ranks, std::size_t n) {
  std::vector<ckpt::DcpWriteTensor> tensors;
  auto data = ckpt::memory_source(std::vector<std::byte>(64 * 4));
  for (std::size_t k = 0; k < n; ++k) {
    ckpt::DcpWriteTensor t{"model.layers." + std::to_string(k / 10) + ".w" + std::to_string(k % 10), ckpt::DType::kFloat32,
                           {8 * ranks, 8}, {}, false};
    for (int r = 0; r < ranks; ++r) {
      t.chunks.push_back({r, {8 * r, 0}, {8, 8}, ckpt::sub_source(data, 0, 64 * 4, "chunk")});
    }
    tensors.push_back(std::move(t));
  }
  ckpt::DcpWriteOptions o;
  o.world_size = ranks;
  o.layout = ckpt::DcpLayout::kTorch113;
  o.overwrite = ckpt::Overwrite::kYes;
  ckpt::write_dcp(dir, tensors, {}, o);
  return 0;
}

int parse_only(const std::filesystem::path& file) {
  auto src = ckpt::open_mmap(file);
  auto bytes = *src->view(0, src->size());
  auto t = Clock::now();
  ckpt::pickle::ParseOptions o;
  {
    auto root = ckpt::pickle::parse(bytes, file.string(), 0, o);
    std::fprintf(stderr, "parse %.1f ms\n", seconds_since(t) * 1e3);
    t = Clock::now();
  }
  std::fprintf(stderr, "free %.1f ms\n", seconds_since(t) * 1e3);
  t = Clock::now();
  auto c = ckpt::open_checkpoint(file.parent_path());
  std::fprintf(stderr, "open_checkpoint %.1f ms\n", seconds_since(t) * 1e3);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "crc") return crc(argc > 2 ? std::stoul(argv[2]) : 1024);
  if (cmd == "write" && argc > 2) return write(argv[2], argc > 3 ? std::stoul(argv[3]) : 1024);
  if (cmd == "make-many" && argc > 2) return make_many(argv[2], argc > 3 ? std::stoul(argv[3]) : 1000);
  if (cmd == "make-dcp" && argc > 4) return make_dcp(argv[2], std::stoi(argv[3]), std::stoul(argv[4]));
  if (cmd == "parse" && argc > 2) return parse_only(argv[2]);
  if (cmd == "open" && argc > 2) return open_list(argv[2], argc > 3 ? std::stoi(argv[3]) : 51);
  std::fprintf(stderr, "usage: see the comment at the top of bench/bench_ckpt.cpp\n");
  return 2;
}
