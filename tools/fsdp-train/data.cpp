// SPDX-License-Identifier: Apache-2.0
#include "fsdp-train/data.hpp"

#include <filesystem>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace fsdp_train {

std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

namespace {

std::vector<std::uint16_t> synthetic(int vocab, std::uint64_t seed) {
  constexpr std::size_t kTokens = 1 << 20;
  std::vector<std::uint16_t> t(kTokens);
  std::uint64_t state = mix64(seed ^ 0x5EED);
  t[0] = static_cast<std::uint16_t>(1 % vocab);
  t[1] = static_cast<std::uint16_t>(2 % vocab);
  for (std::size_t i = 2; i < kTokens; ++i) {
    state = mix64(state);
    if (state % 16 == 0) {
      t[i] = static_cast<std::uint16_t>((state >> 8) % static_cast<std::uint64_t>(vocab));
    } else {
      t[i] = static_cast<std::uint16_t>((3u * t[i - 1] + t[i - 2] + 1u) % static_cast<unsigned>(vocab));
    }
  }
  return t;
}

std::vector<std::uint16_t> from_file(const std::string& path, int vocab) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open the data file" + (errno ? std::string(": ") + std::strerror(errno) : std::string()));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::uint16_t> t;
  const bool bin = std::filesystem::path(path).extension() == ".bin";
  if (bin) {
    if (bytes.size() % 2) throw std::runtime_error(path + ": at byte offset " + std::to_string(bytes.size() - 1) + ": a uint16 token file has an odd size");
    t.resize(bytes.size() / 2);
    for (std::size_t i = 0; i < t.size(); ++i) {
      t[i] = static_cast<std::uint16_t>(static_cast<unsigned char>(bytes[2 * i]) | (static_cast<unsigned char>(bytes[2 * i + 1]) << 8));
    }
  } else {
    t.reserve(bytes.size());
    for (char c : bytes) t.push_back(static_cast<unsigned char>(c));
  }
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i] >= vocab) {
      throw std::runtime_error(path + ": at byte offset " + std::to_string(bin ? 2 * i : i) + ": token " + std::to_string(t[i]) +
                               " is not below the vocabulary size " + std::to_string(vocab) +
                               (bin ? "" : " (a text file's bytes are its tokens: use --vocab-size 256)"));
    }
  }
  return t;
}

}  // namespace

TokenData load_tokens(const std::string& spec, int vocab, int block, double val_fraction, std::uint64_t seed) {
  TokenData d;
  d.source = spec;
  d.tokens = spec == "synthetic" ? synthetic(vocab, seed) : from_file(spec, vocab);
  const std::size_t n = d.tokens.size();
  const auto val = static_cast<std::size_t>(static_cast<double>(n) * val_fraction);
  d.train_end = n - val;
  const std::size_t need = static_cast<std::size_t>(block) + 1;
  if (d.train_end < need || (val_fraction > 0 && val < need)) {
    throw std::runtime_error(spec + ": " + std::to_string(n) + " tokens are too few for samples of " + std::to_string(need) +
                             " tokens in both the training part and the validation part (" + std::to_string(val_fraction) + ")");
  }
  return d;
}

std::vector<std::size_t> sample_starts(std::uint64_t seed, std::int64_t step, std::size_t first, std::size_t count,
                                       std::size_t begin, std::size_t end, int block_size) {
  const std::size_t range = end - begin - static_cast<std::size_t>(block_size);  // starts in [begin, begin + range)
  std::vector<std::size_t> out;
  out.reserve(count);
  const std::uint64_t base = mix64(seed ^ mix64(static_cast<std::uint64_t>(step)));
  for (std::size_t i = first; i < first + count; ++i) out.push_back(begin + mix64(base ^ i) % range);
  return out;
}

}  // namespace fsdp_train
