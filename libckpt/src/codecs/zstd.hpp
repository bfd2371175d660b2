// SPDX-License-Identifier: Apache-2.0
// zstd, both ways: the one home of libzstd in libckpt. DCP's `stream.zstd/1` transform is one
// zstd frame per item; the DCP driver decides when to use these, they know no format.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ckpt/io.hpp"

namespace ckpt::codecs {

/// Decodes the one zstd frame that fills `in`, as a stream. The frame's recorded content size is
/// not trusted: the output grows as decoded and a frame that decodes past `max_decoded` bytes is
/// refused (kFormat, at the input offset reached). Bytes after the frame, a truncated frame and a
/// corrupt one are refused with their offset in `in`.
SourcePtr zstd_decode(const SourcePtr& in, std::uint64_t max_decoded);

/// A sink that compresses what it is given into one zstd frame written to `parent`. offset()
/// counts the uncompressed bytes (what a compressed item's inner offsets refer to); commit() ends
/// the frame but does not commit `parent`.
std::unique_ptr<ByteSink> zstd_encoder(ByteSink& parent, int level);

}  // namespace ckpt::codecs
