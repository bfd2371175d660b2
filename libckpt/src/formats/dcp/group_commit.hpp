// SPDX-License-Identifier: Apache-2.0
// NOTE [Several processes, one DCP]: processes that each write some of a plan's data files into
// one directory (a reshard spread over a job's tasks) meet through marker files there, as DCP's
// ranks meet through a collective: each process but 0 leaves `.shard-done.<p>` (where its items
// went, as JSON) or `.shard-failed.<p>` (its error), each naming the plan's fingerprint so that a
// marker of another run is never taken for this one's; process 0 waits for every other's, then
// writes `.metadata` last (NOTE [.metadata last]). A process that fails or never finishes leaves
// no `.metadata`, so the directory never looks like a checkpoint.
#pragma once

#include <chrono>
#include <deque>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "formats/dcp/write_plan.hpp"

namespace ckpt::detail {

/// A text that differs between plans that would write different bytes: the source, the plan's
/// layout (world size, files per rank, compression), the process count, every chunk's box and
/// rank, and every object's rank and size.
std::string dcp_plan_fingerprint(const DcpPlan& plan, const std::string& source, int process_count);

class DcpGroupCommit {
 public:
  DcpGroupCommit(std::filesystem::path dir, int process_index, int process_count, std::string fingerprint,
                 std::chrono::milliseconds timeout);
  /// Before writing: creates the directory and removes this process's markers of an earlier run.
  void begin() const;
  /// A process other than 0 has written its files: where its items went.
  void done(const std::vector<DcpItem>& items) const;
  /// Writing failed here: the error, for process 0 to report.
  void failed(const std::string& error) const;
  /// Process 0: every other process's items, once each has finished. Throws kIo when one failed
  /// or did not finish within the timeout, kCancelled on request; no `.metadata` is written then.
  /// The items view names kept by this object.
  std::vector<DcpItem> wait_for_others();

 private:
  std::filesystem::path dir_;
  int index_, count_;
  std::string fingerprint_;
  std::chrono::milliseconds timeout_;
  std::deque<std::string> names_;  // FQNs and file names of the other processes' items (they never move)
  std::deque<std::vector<std::int64_t>> offsets_;
};

}  // namespace ckpt::detail
