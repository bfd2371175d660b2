// SPDX-License-Identifier: Apache-2.0
// Where the nodes of pickle trees live. A metadata pickle makes and drops millions of small nodes
// of a few fixed sizes; a free list per size and thread serves them without malloc's bookkeeping.
// Blocks go back to the list of the thread that frees them and are never returned to the system,
// so memory stays at the most nodes alive at once. Under AddressSanitizer every node is an
// ordinary allocation, so that use-after-free is still caught.
#pragma once

#include <array>
#include <cstddef>
#include <utility>
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
inline constexpr std::size_t kClasses = 16;
template <std::size_t... I>
constexpr auto make_table(std::index_sequence<I...>) {
  struct Entry {
    void* (*get)();
    void (*put)(void*) noexcept;
  };
  return std::array<Entry, sizeof...(I)>{Entry{&BlockPool<16 * (I + 1)>::get, &BlockPool<16 * (I + 1)>::put}...};
}
inline constexpr auto kTable = make_table(std::make_index_sequence<kClasses>{});

inline void* get(std::size_t size) {
  if (size == 0 || size > 16 * kClasses) return ::operator new(size);
  return kTable[(size + 15) / 16 - 1].get();
}
inline void put(void* p, std::size_t size) noexcept {
  if (size == 0 || size > 16 * kClasses) return ::operator delete(p);
  kTable[(size + 15) / 16 - 1].put(p);
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
