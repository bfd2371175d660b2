// SPDX-License-Identifier: Apache-2.0
// The sample checkpoints our writers produce for the interop tests, with a manifest (JSON, beside
// the file) of what was meant: every tensor's path, dtype, shape, stride, offset and storage, and
// each storage's byte pattern. tests/interop/test_torch_save.py loads the file with PyTorch and
// holds it to the manifest.
#pragma once

#include "ckpt/io.hpp"

namespace fsdp_test {

/// The byte pattern of sample storage `s`: byte j is (j * 131 + s * 17 + 7) mod 256 (bool: mod 2).
std::vector<std::byte> sample_bytes(std::size_t s, std::size_t nbytes, bool is_bool);

/// Writes the torch.save sample and `<sink name>.json`, its manifest.
void write_sample_torch_save(ckpt::ByteSink& sink);
/// Writes a DCP directory sample for `world` ranks (layout "current" or "1.13", compression
/// "none" or "zstd") and `<dir>/../<dirname>.json`, its manifest: tensors chunked on dim 0 by
/// torch.chunk's rule, one on dim 1, one with fewer rows than ranks, a 0-d tensor, bytes items.
void write_sample_dcp(const std::string& dir, int world, const std::string& layout, const std::string& compression);
/// Writes a safetensors sample (every dtype it can hold, 0-d and empty tensors, metadata) and its manifest.
void write_sample_safetensors(ckpt::ByteSink& sink);

}  // namespace fsdp_test
