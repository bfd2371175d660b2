// SPDX-License-Identifier: Apache-2.0
// One rank of an fsdp-train run.
#pragma once

#include <map>
#include <string>

#include "fsdp-train/config.hpp"

namespace fsdp_train {

/// Trains as the rank the environment names (a world of one when it names none). Returns the exit
/// status; throws on errors (fsdp::Error, std::runtime_error) with a message for the user.
/// Refuses options the strategy refuses (a device this build or machine lacks, a contradiction),
/// before any rank starts; throws fsdp::Error.
void check_strategy(const TrainConfig& config);

int run_rank(const TrainConfig& config, const std::map<std::string, std::string>& env);

}  // namespace fsdp_train
