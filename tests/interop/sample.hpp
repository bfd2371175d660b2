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
/// Writes a safetensors sample (every dtype it can hold, 0-d and empty tensors, metadata) and its manifest.
void write_sample_safetensors(ckpt::ByteSink& sink);

}  // namespace fsdp_test
