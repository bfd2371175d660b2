#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The CUDA/NCCL path, on a machine with a GPU and PyTorch 2.x (pip, with CUDA): builds libfsdp,
# the device test and fsdp-train against that PyTorch's own LibTorch (FSDP_HAS_NCCL=1; libckpt and
# the rest come prebuilt in .dev/, see prepare.sh), then
#  1. fsdp_device_test cuda: a world of one on nccl, 32-true, bf16-mixed and 16-mixed against plain
#     LibTorch on the GPU, sharded and full checkpoints saved from the GPU and loaded back;
#  2. PyTorch 2.x loads those checkpoints (dcp.load, torch.load(weights_only=True));
#  3. fsdp-train --device cuda (32-true, bf16-mixed, 16-mixed), a checkpoint merged and loaded by
#     PyTorch 2.x, and resumed on the CPU at 2 ranks (gloo): a checkpoint is the same from either;
#  4. tests/interop/pytorch2/run.py: PyTorch 2.x and the checkpoint tools, each reading the other.
# Usage (repository root): bash tests/gpu/run.sh [OUTDIR]. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-/tmp/fsdp-gpu}}
mkdir -p "$out"
exec > >(tee "$out/gpu.log") 2>&1
py=${PYTHON:-python3}
failed=0
step() { echo; echo "== $*"; }
check() { if "$@"; then echo "ok: $*"; else echo "FAILED ($?): $*"; failed=$((failed + 1)); fi; }

# FSDP_GPU_DRYRUN=1: this script's build and CPU steps on a machine without CUDA (Debian's torch
# 1.13 headers and libraries, no NCCL), to check the script itself before spending device time.
dry=${FSDP_GPU_DRYRUN:-0}

step "machine"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
g++ --version | head -n 1
eval "$($py - <<'PY'
import os, sys, torch
d = os.path.dirname(torch.__file__)
print(f"torch_dir={d}")
print(f"torch_version={torch.__version__}")
print(f"torch_cuda={int(torch.cuda.is_available())}")
print(f"cxx11_abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
# CUDA's and NCCL's headers: the pip wheels' nvidia packages, or a system CUDA.
inc = []
for mod in ("nvidia.cuda_runtime", "nvidia.nccl"):
    try:
        m = __import__(mod, fromlist=["x"])
        for p in getattr(m, "__path__", []):
            if os.path.isdir(os.path.join(p, "include")):
                inc.append(os.path.join(p, "include"))
    except ImportError:
        pass
for p in ("/usr/local/cuda/include",):
    if os.path.isdir(p):
        inc.append(p)
print("cuda_inc='" + " ".join("-isystem " + p for p in inc) + "'")
PY
)"
if [[ $dry == 1 ]]; then
  torch_inc=(-isystem /usr/include/torch/csrc/api/include) torch_lib=(-L/usr/lib/x86_64-linux-gnu) nccl=0 cuda_libs=()
  py=/bin/true
else
  torch_inc=(-isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include")
  torch_lib=(-L"$torch_dir/lib" -Wl,-rpath,"$torch_dir/lib") nccl=1 cuda_libs=(-ltorch_cuda -lc10_cuda)
fi
echo "torch $torch_version at $torch_dir, cuda available: $torch_cuda, cxx11 abi: $cxx11_abi"
[[ $cxx11_abi == 1 ]] || { echo "this torch uses the old C++ ABI; libckpt.a was built with the new one"; exit 100; }
[[ -f .dev/lib/libckpt.a ]] || { echo ".dev/ is empty: run tests/gpu/prepare.sh here and carry .dev"; exit 100; }

step "build against torch $torch_version's LibTorch (FSDP_HAS_NCCL=$nccl)"
b=build-gpu
mkdir -p $b/obj
flags=(-std=c++20 -O2 -g0 -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 -DFSDP_HAS_NCCL=$nccl -DUSE_C10D_GLOO -DUSE_C10D_NCCL -DUSE_DISTRIBUTED
       "${torch_inc[@]}" $cuda_inc -isystem .dev/include
       -Ilibfsdp/include -Ilibfsdp/src -Ilibckpt/include -Itools -Itests/fsdp -Wall -Wextra -Werror=deprecated-declarations)
srcs=(libfsdp/src/*.cpp tests/fsdp/test_device.cpp tools/fsdp-train/*.cpp)
printf '%s\n' "${srcs[@]}" | xargs -P "$(nproc)" -I{} sh -c 'g++ "$@" -c {} -o '"$b"'/obj/$(echo {} | tr / _).o || echo "COMPILE FAILED: {}"' _ "${flags[@]}" 2>&1 | grep -v "^$" | tail -n 60
libs=("${torch_lib[@]}" -Wl,--no-as-needed -ltorch "${cuda_libs[@]}" -ltorch_cpu -lc10 -Wl,--as-needed
      .dev/lib/libfsdp_tools_common.a .dev/lib/libckpt.a .dev/lib/libzstd.a .dev/lib/libdeflate.a -lz -lpthread -ldl)
fsdp_objs=($b/obj/libfsdp_src_*.o)
check g++ -o $b/fsdp_device_test $b/obj/tests_fsdp_test_device.cpp.o "${fsdp_objs[@]}" "${libs[@]}"
check g++ -rdynamic -o $b/fsdp-train $b/obj/tools_fsdp-train_*.o "${fsdp_objs[@]}" "${libs[@]}"
[[ -x $b/fsdp_device_test && -x $b/fsdp-train ]] || { echo "build failed"; exit 100; }

if [[ $dry == 1 ]]; then
  check $b/fsdp_device_test cpu
  check $b/fsdp-train --device cpu --nproc 2 --model gpt --data testdata/text/fsdp-tools-docs.txt --steps 4 --log-every 2 --ckpt-dir "$out/dry"
  check .dev/bin/fsdp-ckpt-inspect verify --deep "$(ls -d "$out"/dry/step-* | tail -n 1)"
  step "dry run done: $failed failed"
  exit $failed
fi

step "1. fsdp_device_test cuda (nccl, a world of one)"
export FSDP_DEVICE_TEST_KEEP=1
$b/fsdp_device_test cuda | tee "$out/device_test.txt"
rc=${PIPESTATUS[0]}
[[ $rc == 0 ]] && echo "ok: fsdp_device_test cuda" || { echo "FAILED ($rc): fsdp_device_test cuda"; failed=$((failed + 1)); }
kept=$(sed -n 's/^kept //p' "$out/device_test.txt")

step "1b. the same test on the CPU, this build (gloo)"
check $b/fsdp_device_test cpu

step "2. PyTorch $torch_version loads what the GPU saved"
[[ -n $kept ]] && check $py tests/gpu/check_torch2.py device "$kept"

step "3. fsdp-train --device cuda"
text=testdata/text/fsdp-tools-docs.txt
export LD_LIBRARY_PATH=.dev/lib:${LD_LIBRARY_PATH:-}
rm -rf "$out/train" "$out/train_bf16" "$out/train_fp16" "$out/train_cpu"
check $b/fsdp-train --device cuda --nproc 1 --model gpt --data $text --steps 60 --lr 3e-3 --log-every 20 \
  --ckpt-dir "$out/train" --save-every 30 --log-jsonl "$out/train.jsonl"
check $b/fsdp-train --device cuda --nproc 1 --model gpt --data $text --steps 30 --lr 3e-3 --log-every 10 --precision bf16-mixed \
  --ckpt-dir "$out/train_bf16" --log-jsonl "$out/train_bf16.jsonl"
check $b/fsdp-train --device cuda --nproc 1 --model gpt --data $text --steps 30 --lr 3e-3 --log-every 10 --precision 16-mixed \
  --ckpt-dir "$out/train_fp16" --log-jsonl "$out/train_fp16.jsonl"
ck=$(ls -d "$out"/train/step-* 2>/dev/null | tail -n 1)
if [[ -n $ck ]]; then
  check .dev/bin/fsdp-ckpt-inspect verify --deep "$ck"
  check .dev/bin/fsdp-ckpt-merge "$ck" -o "$out/model.pt" --force
  check $py tests/gpu/check_torch2.py train "$ck" "$out/model.pt"
  step "3b. the GPU's checkpoint resumed on the CPU at 2 ranks (gloo)"
  check $b/fsdp-train --device cpu --nproc 2 --model gpt --data $text --steps 70 --lr 3e-3 --log-every 5 --batch-size 4 \
    --resume "$ck" --ckpt-dir "$out/train_cpu" --log-jsonl "$out/train_cpu.jsonl"
fi
step "4. PyTorch $torch_version reads and writes checkpoints with our tools (tests/interop/pytorch2/run.py, on the CPU)"
check timeout 300 $py tests/interop/pytorch2/run.py --probe .dev/bin/ckpt_probe --inspect .dev/bin/fsdp-ckpt-inspect \
  --merge .dev/bin/fsdp-ckpt-merge --shard .dev/bin/fsdp-ckpt-shard
step "done: $failed failed"
exit $failed
