// SPDX-License-Identifier: Apache-2.0
// Small helpers for unit tests: a fresh temporary directory per test, fixture paths, byte patching,
// and the skip convention (exit 77, which CTest reports as skipped).
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "ckpt/io.hpp"

namespace fsdp_test {

class TestDir {
 public:
  TestDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp-test-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TestDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline std::filesystem::path testdata(const std::string& rel) { return std::filesystem::path(FSDP_TESTDATA_DIR) / rel; }

/// A file from ../shared/testdata-real, or a skip (exit 77) naming what is missing.
inline std::filesystem::path shared_testdata_or_skip(const std::string& rel) {
  auto p = std::filesystem::path(FSDP_SHARED_TESTDATA_DIR) / rel;
  if (!std::filesystem::exists(p)) {
    std::cout << "SKIPPED: " << p << " is absent (the shared real-checkpoint folder is not beside the project)\n";
    std::exit(77);
  }
  return p;
}

inline std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) b[i] = static_cast<std::byte>(s[i]);
  return b;
}

inline std::vector<std::byte> read_all(const std::filesystem::path& p) {
  auto src = ckpt::open_file(p);
  return src->read_vector(0, src->size());
}

inline void put_u16(std::vector<std::byte>& b, std::size_t at, std::uint16_t v) {
  for (int i = 0; i < 2; ++i) b.at(at + static_cast<std::size_t>(i)) = static_cast<std::byte>(v >> (8 * i));
}
inline void put_u32(std::vector<std::byte>& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b.at(at + static_cast<std::size_t>(i)) = static_cast<std::byte>(v >> (8 * i));
}
inline void put_u64(std::vector<std::byte>& b, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b.at(at + static_cast<std::size_t>(i)) = static_cast<std::byte>(v >> (8 * i));
}

inline std::size_t find(const std::vector<std::byte>& hay, const std::string& needle, std::size_t from = 0) {
  for (std::size_t i = from; i + needle.size() <= hay.size(); ++i) {
    bool ok = true;
    for (std::size_t k = 0; k < needle.size() && ok; ++k) ok = hay[i + k] == static_cast<std::byte>(needle[k]);
    if (ok) return i;
  }
  throw std::runtime_error("test helper: '" + needle + "' not found");
}

}  // namespace fsdp_test
