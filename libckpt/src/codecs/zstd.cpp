// SPDX-License-Identifier: Apache-2.0
#include "codecs/zstd.hpp"

#include <zstd.h>

#include <string>

#include "ckpt/error.hpp"

namespace ckpt::codecs {

SourcePtr zstd_decode(const SourcePtr& in, std::uint64_t max_decoded) {
  std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> ctx(ZSTD_createDCtx(), ZSTD_freeDCtx);
  if (!ctx) internal_error("ZSTD_createDCtx failed");
  std::vector<std::byte> out;
  std::vector<std::byte> chunk(ZSTD_DStreamOutSize());
  std::uint64_t consumed = 0;
  size_t ret = 1;
  stream_range(*in, 0, in->size(), [&](std::span<const std::byte> piece) {
    ZSTD_inBuffer ib{piece.data(), piece.size(), 0};
    while (ib.pos < ib.size) {
      if (ret == 0) {
        throw Error(ErrorKind::kFormat, in->name(), consumed + ib.pos, "bytes follow the end of the zstd frame (one frame per item)");
      }
      ZSTD_outBuffer ob{chunk.data(), chunk.size(), 0};
      ret = ZSTD_decompressStream(ctx.get(), &ob, &ib);
      if (ZSTD_isError(ret)) {
        throw Error(ErrorKind::kFormat, in->name(), consumed + ib.pos, std::string("zstd: ") + ZSTD_getErrorName(ret));
      }
      if (out.size() + ob.pos > max_decoded) {
        throw Error(ErrorKind::kFormat, in->name(), consumed + ib.pos,
                    "zstd item decodes to more than " + std::to_string(max_decoded) + " bytes");
      }
      out.insert(out.end(), chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(ob.pos));
    }
    consumed += piece.size();
  });
  if (ret != 0) throw Error(ErrorKind::kFormat, in->name(), in->size(), "zstd frame is truncated");
  return memory_source(std::move(out), in->name() + "[zstd]");
}

namespace {

class ZstdSink final : public ByteSink {
 public:
  ZstdSink(ByteSink& parent, int level) : parent_(parent), ctx_(ZSTD_createCCtx(), ZSTD_freeCCtx), name_(parent.name()) {
    if (!ctx_) internal_error("ZSTD_createCCtx failed");
    ZSTD_CCtx_setParameter(ctx_.get(), ZSTD_c_compressionLevel, level);
    out_.resize(ZSTD_CStreamOutSize());
  }
  const std::string& name() const noexcept override { return name_; }
  void write(std::span<const std::byte> b) override {
    ZSTD_inBuffer in{b.data(), b.size(), 0};
    while (in.pos < in.size) pump(&in, ZSTD_e_continue);
    written_ += b.size();
  }
  using ByteSink::write;
  std::uint64_t offset() const noexcept override { return written_; }
  void commit() override {
    ZSTD_inBuffer in{nullptr, 0, 0};
    while (pump(&in, ZSTD_e_end) != 0) {
    }
  }

 private:
  std::size_t pump(ZSTD_inBuffer* in, ZSTD_EndDirective mode) {
    ZSTD_outBuffer ob{out_.data(), out_.size(), 0};
    const std::size_t r = ZSTD_compressStream2(ctx_.get(), &ob, in, mode);
    if (ZSTD_isError(r)) throw Error(ErrorKind::kIo, name_, std::nullopt, std::string("zstd: ") + ZSTD_getErrorName(r));
    parent_.write(std::span(out_).first(ob.pos));
    return r;
  }
  ByteSink& parent_;
  std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> ctx_;
  std::vector<std::byte> out_;
  std::uint64_t written_ = 0;
  std::string name_;
};

}  // namespace

std::unique_ptr<ByteSink> zstd_encoder(ByteSink& parent, int level) { return std::make_unique<ZstdSink>(parent, level); }

}  // namespace ckpt::codecs
