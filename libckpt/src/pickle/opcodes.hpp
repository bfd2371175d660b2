// SPDX-License-Identifier: Apache-2.0
// Pickle opcode bytes (docs/formats/pickle.md#opcodes), shared by the unpickler and the pickler.
#pragma once

#include <cstdint>

namespace ckpt::pickle::op {
inline constexpr std::uint8_t kProto = 0x80, kFrame = 0x95, kStop = '.', kMark = '(', kEmptyTuple = ')',
                              kTuple1 = 0x85, kTuple2 = 0x86, kTuple3 = 0x87, kTuple = 't', kEmptyList = ']',
                              kAppend = 'a', kAppends = 'e', kEmptyDict = '}', kSetItem = 's', kSetItems = 'u',
                              kEmptySet = 0x8f, kAddItems = 0x90, kFrozenSet = 0x91, kNone = 'N', kNewTrue = 0x88,
                              kNewFalse = 0x89, kBinInt1 = 'K', kBinInt2 = 'M', kBinInt = 'J', kLong1 = 0x8a,
                              kLong4 = 0x8b, kBinFloat = 'G', kBinUnicode = 'X', kShortBinUnicode = 0x8c,
                              kBinUnicode8 = 0x8d, kShortBinBytes = 'C', kBinBytes = 'B', kBinBytes8 = 0x8e,
                              kShortBinString = 'U', kGlobal = 'c', kStackGlobal = 0x93, kReduce = 'R',
                              kNewObj = 0x81, kNewObjEx = 0x92, kBuild = 'b', kBinPersId = 'Q', kBinPut = 'q',
                              kLongBinPut = 'r', kMemoize = 0x94, kBinGet = 'h', kLongBinGet = 'j';
}  // namespace ckpt::pickle::op
