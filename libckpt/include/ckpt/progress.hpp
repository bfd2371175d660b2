// SPDX-License-Identifier: Apache-2.0
// Progress: how long work reports how far it got. The library never prints; tools draw a bar.
#pragma once

#include <cstdint>
#include <string_view>

namespace ckpt {

class Progress {
 public:
  virtual ~Progress() = default;
  /// A new phase of `total` units (bytes, unless `what` says otherwise).
  virtual void start(std::string_view what, std::uint64_t total) { (void)what, (void)total; }
  virtual void advance(std::uint64_t units) { (void)units; }
  virtual void finish() {}
  /// Something the user should know that is not an error: what was left out, what was cleaned up,
  /// what a cast changed. One line, without a trailing newline.
  virtual void note(std::string_view message) { (void)message; }
};

/// Reports nothing.
inline Progress& no_progress() {
  static Progress p;
  return p;
}

}  // namespace ckpt
