// SPDX-License-Identifier: Apache-2.0
// ckpt::Dims, a chunk's offsets or sizes: a vector of int64 that keeps up to two values inline.
//
// NOTE [Compact chunks]: a checkpoint of a large model has hundreds of thousands of chunks, and
// nearly all of them are 1-d or 2-d. With std::vector every chunk paid two heap blocks (32 bytes
// each with malloc's header) on top of the vectors themselves; Dims holds 1-d and 2-d boxes in its
// own 24 bytes (the size of a std::vector) and goes to the heap only from 3-d up. It is a
// contiguous range, so it passes as the std::span<const std::int64_t> the box arithmetic takes.
#pragma once

#include <algorithm>
#include <compare>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <vector>

namespace ckpt {

class Dims {
 public:
  static constexpr std::uint32_t kInline = 2;

  Dims() noexcept = default;
  Dims(std::initializer_list<std::int64_t> v) { assign(v.begin(), v.size()); }
  Dims(const std::vector<std::int64_t>& v) { assign(v.data(), v.size()); }  // NOLINT(google-explicit-constructor)
  explicit Dims(std::span<const std::int64_t> v) { assign(v.data(), v.size()); }
  Dims(const Dims& o) { assign(o.data(), o.size()); }
  Dims(Dims&& o) noexcept { steal(o); }
  Dims& operator=(const Dims& o) {
    if (this != &o) assign(o.data(), o.size());
    return *this;
  }
  Dims& operator=(Dims&& o) noexcept {
    if (this != &o) {
      release();
      steal(o);
    }
    return *this;
  }
  ~Dims() { release(); }

  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  const std::int64_t* data() const noexcept { return on_heap() ? u_.heap : u_.inline_; }
  std::int64_t* data() noexcept { return on_heap() ? u_.heap : u_.inline_; }
  std::int64_t operator[](std::size_t i) const noexcept { return data()[i]; }
  std::int64_t& operator[](std::size_t i) noexcept { return data()[i]; }
  std::int64_t back() const noexcept { return data()[size_ - 1]; }
  const std::int64_t* begin() const noexcept { return data(); }
  const std::int64_t* end() const noexcept { return data() + size_; }
  std::int64_t* begin() noexcept { return data(); }
  std::int64_t* end() noexcept { return data() + size_; }

  void push_back(std::int64_t v) {
    if (size_ == capacity()) grow(std::max<std::uint32_t>(4, 2 * size_));
    data()[size_++] = v;
  }
  void clear() noexcept { size_ = 0; }

  std::span<const std::int64_t> span() const noexcept { return {data(), size_}; }
  std::vector<std::int64_t> vec() const { return {begin(), end()}; }
  operator std::vector<std::int64_t>() const { return vec(); }  // NOLINT(google-explicit-constructor)

  friend bool operator==(const Dims& a, const Dims& b) noexcept {
    return a.size_ == b.size_ && std::equal(a.begin(), a.end(), b.begin());
  }
  friend std::strong_ordering operator<=>(const Dims& a, const Dims& b) noexcept {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  bool on_heap() const noexcept { return cap_ > kInline; }
  std::uint32_t capacity() const noexcept { return on_heap() ? cap_ : kInline; }
  void assign(const std::int64_t* p, std::size_t n) {
    size_ = 0;
    if (n > capacity()) grow(static_cast<std::uint32_t>(n));
    if (n) std::memmove(data(), p, n * sizeof(std::int64_t));
    size_ = static_cast<std::uint32_t>(n);
  }
  void grow(std::uint32_t cap) {
    auto* h = new std::int64_t[cap];
    if (size_) std::memcpy(h, data(), size_ * sizeof(std::int64_t));
    release();
    u_.heap = h;
    cap_ = cap;
  }
  void release() noexcept {
    if (on_heap()) delete[] u_.heap;
    cap_ = 0;
  }
  void steal(Dims& o) noexcept {
    u_ = o.u_;
    size_ = o.size_;
    cap_ = o.cap_;
    o.size_ = 0;
    o.cap_ = 0;
  }

  union U {
    std::int64_t inline_[kInline];
    std::int64_t* heap;
  } u_{};
  std::uint32_t size_ = 0;
  std::uint32_t cap_ = 0;  ///< 0 while inline; the heap block's capacity (> kInline) once there
};

static_assert(sizeof(Dims) == 24);

}  // namespace ckpt
