// SPDX-License-Identifier: Apache-2.0
// fsdp-train's data: a token stream (synthetic, a nanoGPT uint16 .bin file, or a text file's
// bytes), split into training and validation parts, and the batches drawn from it. A step's global
// batch depends only on the seed, the step and the global batch size, never on the world size:
// sample i of step s starts at a position drawn from (seed, s, i), and rank r of a world of W,
// each taking b samples per micro-batch, takes samples [(m·W + r)·b, (m·W + r + 1)·b) of micro-batch
// m. So one rank with batch 8 and two ranks with batch 4 see the same 8 sequences.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_train {

struct TokenData {
  std::vector<std::uint16_t> tokens;
  std::size_t train_end = 0;  ///< tokens [0, train_end) train, [train_end, size) validate
  std::string source;         ///< for messages: "synthetic", or the file
};

/// `spec` is "synthetic" (a seeded stream with structure a model can learn: each token follows
/// from the two before it, with occasional noise), a `.bin` file (uint16 little-endian, as
/// nanoGPT's prepare.py writes) or any other file (its bytes are the tokens). Every token must be
/// below `vocab_size` (a file's first one that is not is an error naming its byte offset). The
/// last `val_fraction` of the stream validates; both parts must hold at least one sample of
/// `block_size` + 1 tokens. Throws std::runtime_error naming the file.
TokenData load_tokens(const std::string& spec, int vocab_size, int block_size, double val_fraction, std::uint64_t seed);

/// The start positions of samples [first, first + count) of step `step`'s batch, in
/// [begin, end - block_size - 1]. Validation batches use negative steps.
std::vector<std::size_t> sample_starts(std::uint64_t seed, std::int64_t step, std::size_t first, std::size_t count,
                                       std::size_t begin, std::size_t end, int block_size);

/// splitmix64: the one mixing function the batches are drawn with (tests reproduce it).
std::uint64_t mix64(std::uint64_t x) noexcept;

}  // namespace fsdp_train
