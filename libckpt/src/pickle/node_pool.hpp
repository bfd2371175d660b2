// SPDX-License-Identifier: Apache-2.0
// Where the nodes of pickle trees live. A metadata pickle makes and drops millions of small nodes
// of a few fixed sizes; a free list per size and thread serves them without malloc's bookkeeping.
// Blocks go back to the list of the thread that frees them and are never returned to the system,
// so memory stays at the most nodes alive at once. Under AddressSanitizer every node is an
// ordinary allocation, so that use-after-free is still caught.
#pragma once

#include <cstddef>
#include <memory>
#include <new>

#include "ckpt/pickle.hpp"

#if defined(__SANITIZE_ADDRESS__)  // GCC
#define CKPT_NODE_POOL 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)  // clang
#define CKPT_NODE_POOL 0
#endif
#endif
#ifndef CKPT_NODE_POOL
#define CKPT_NODE_POOL 1
#endif

namespace ckpt::pickle::pool {

#if !CKPT_NODE_POOL
inline void* get(std::size_t size) { return ::operator new(size); }
inline void put(void* p, std::size_t) noexcept { ::operator delete(p); }
#else
template <std::size_t Size>
class BlockPool {
 public:
  static void* get() {
    Free*& head = list();
    if (!head) refill();
    Free* f = head;
    head = f->next;
    return f;
  }
  static void put(void* p) noexcept {
    Free*& head = list();
    auto* f = static_cast<Free*>(p);
    f->next = head;
    head = f;
  }

 private:
  struct Free { Free* next; };
  static constexpr std::size_t kBlock = (Size + alignof(std::max_align_t) - 1) / alignof(std::max_align_t) * alignof(std::max_align_t);
  static constexpr std::size_t kSlab = 64 * 1024;
  static Free*& list() {
    thread_local Free* head = nullptr;
    return head;
  }
  static void refill() {
    auto* slab = static_cast<std::byte*>(::operator new(kSlab));  // kept for the process's life
    for (std::size_t off = 0; off + kBlock <= kSlab; off += kBlock) put(slab + off);
  }
};

// Sizes are rounded up to classes of 16 bytes up to 256; larger ones use the global heap.
inline void* get(std::size_t size) {
  if (size > 256) return ::operator new(size);
  switch ((size + 15) / 16) {
#define CKPT_POOL_CLASS(n) \
  case n: return BlockPool<16 * n>::get();
    CKPT_POOL_CLASS(1) CKPT_POOL_CLASS(2) CKPT_POOL_CLASS(3) CKPT_POOL_CLASS(4) CKPT_POOL_CLASS(5) CKPT_POOL_CLASS(6)
    CKPT_POOL_CLASS(7) CKPT_POOL_CLASS(8) CKPT_POOL_CLASS(9) CKPT_POOL_CLASS(10) CKPT_POOL_CLASS(11) CKPT_POOL_CLASS(12)
    CKPT_POOL_CLASS(13) CKPT_POOL_CLASS(14) CKPT_POOL_CLASS(15) CKPT_POOL_CLASS(16)
#undef CKPT_POOL_CLASS
    default: return ::operator new(size);
  }
}
inline void put(void* p, std::size_t size) noexcept {
  if (size > 256) return ::operator delete(p);
  switch ((size + 15) / 16) {
#define CKPT_POOL_CLASS(n) \
  case n: return BlockPool<16 * n>::put(p);
    CKPT_POOL_CLASS(1) CKPT_POOL_CLASS(2) CKPT_POOL_CLASS(3) CKPT_POOL_CLASS(4) CKPT_POOL_CLASS(5) CKPT_POOL_CLASS(6)
    CKPT_POOL_CLASS(7) CKPT_POOL_CLASS(8) CKPT_POOL_CLASS(9) CKPT_POOL_CLASS(10) CKPT_POOL_CLASS(11) CKPT_POOL_CLASS(12)
    CKPT_POOL_CLASS(13) CKPT_POOL_CLASS(14) CKPT_POOL_CLASS(15) CKPT_POOL_CLASS(16)
#undef CKPT_POOL_CLASS
    default: return ::operator delete(p);
  }
}
#endif

/// An allocator over the pools, for std::allocate_shared and containers of nodes.
template <class T>
struct PoolAllocator {
  using value_type = T;
  PoolAllocator() = default;
  template <class U>
  PoolAllocator(const PoolAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor)
  T* allocate(std::size_t n) { return static_cast<T*>(get(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { put(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const PoolAllocator<U>&) const noexcept { return true; }
};

/// A new, empty node from the pool.
inline ValuePtr new_node() { return std::allocate_shared<Value>(PoolAllocator<Value>{}); }

}  // namespace ckpt::pickle::pool
