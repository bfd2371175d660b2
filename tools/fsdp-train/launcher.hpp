// SPDX-License-Identifier: Apache-2.0
// `fsdp-train --nproc N`: starts N local ranks (this executable again, with torchrun's variables
// set), forwards SIGINT/SIGTERM to them, and when one fails stops the others and says which.
#pragma once

namespace fsdp_train {

/// Runs `argv` as `nproc` ranks of one world on this machine (RANK, LOCAL_RANK, WORLD_SIZE,
/// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT a free port). Each rank dies with the
/// launcher (no orphans). Returns 0 when every rank exits 0; otherwise prints which rank failed
/// first and how, sends the others SIGTERM (SIGKILL 10 s later) and returns 1.
int launch_local(int nproc, int argc, char** argv);

}  // namespace fsdp_train
