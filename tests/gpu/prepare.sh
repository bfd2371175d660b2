#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fills .dev/ (git-ignored) with what tests/gpu/run.sh needs on the GPU machine, which has
# PyTorch 2.x (pip, with CUDA) and a compiler but none of Debian's packages: libckpt and the
# tools' common code built here (Release, without LibTorch: they never include it), the static
# libraries they link, the headers libfsdp and fsdp-train include beside LibTorch's (Gloo's, which
# the pip wheel lacks, CLI11, nlohmann), and the checkpoint tools. Then, from the device tool:
#   run --carry .dev -- bash tests/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ ! -f build-rel/build.ninja ]]; then
  cmake -S . -B build-rel -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_WITH_TORCH=OFF -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
fi
cmake --build build-rel --target ckpt fsdp_tools_common fsdp-ckpt-inspect fsdp-ckpt-merge fsdp-ckpt-shard ckpt_probe
rm -rf .dev && mkdir -p .dev/lib .dev/include .dev/bin
cp build-rel/libckpt/libckpt.a build-rel/tools/libfsdp_tools_common.a .dev/lib/
cp /usr/lib/x86_64-linux-gnu/libzstd.a /usr/lib/x86_64-linux-gnu/libdeflate.a .dev/lib/
cp -r /usr/include/gloo /usr/include/CLI /usr/include/nlohmann .dev/include/
cp build-rel/tools/generated/fsdp_version.hpp .dev/include/
cp build-rel/tools/fsdp-ckpt-inspect build-rel/tools/fsdp-ckpt-merge build-rel/tools/fsdp-ckpt-shard build-rel/tests/ckpt_probe .dev/bin/
# The tools link libdeflate statically only when CMake chose so; carry its shared library too.
cp /usr/lib/x86_64-linux-gnu/libdeflate.so.0 .dev/lib/
du -sh .dev
