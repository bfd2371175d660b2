#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Pickle interop: CPython pickles (protocols 2 and 4) parsed by our unpickler and written back by
our pickler must be byte-identical to CPython's; hostile pickles are refused, never run."""
import collections
import dataclasses
import enum
import os
import pathlib
import pickle
import sys
import types

sys.path.insert(0, os.path.dirname(__file__))
from common import args, check, finish, import_torch, probe, tmpdir  # noqa: E402

a = args()
torch = import_torch()
work = tmpdir()

# Stand-ins for DCP's classes at their torch 2.x module path, with the fields docs/formats/dcp.md#metadata
# gives (torch.distributed.checkpoint cannot be imported on Python 3.11 with torch 1.13).
mod = types.ModuleType("torch.distributed.checkpoint.metadata")
sys.modules[mod.__name__] = mod


def dcp_class(cls):
    cls.__module__ = mod.__name__
    cls.__qualname__ = cls.__name__
    setattr(mod, cls.__name__, cls)
    return cls


@dcp_class
@dataclasses.dataclass
class ChunkStorageMetadata:
    offsets: object
    sizes: object


@dcp_class
class _MEM_FORMAT_ENCODING(enum.Enum):
    TORCH_CONTIGUOUS_FORMAT = 0


@dcp_class
@dataclasses.dataclass
class TensorProperties:
    dtype: object
    layout: object = torch.strided
    requires_grad: bool = False
    memory_format: object = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    pin_memory: bool = False

    def __getstate__(self):
        return (self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory)

    def __setstate__(self, s):
        (self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory) = s


@dcp_class
@dataclasses.dataclass
class TensorStorageMetadata:
    properties: object
    size: object
    chunks: list


@dcp_class
@dataclasses.dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: object = None
    index: object = None


@dcp_class
class BytesStorageMetadata:
    pass


@dcp_class
@dataclasses.dataclass
class Metadata:
    state_dict_metadata: dict
    planner_data: object = None
    storage_data: object = None


def samples():
    shared_s = "shared-string"
    shared_l = [1, 2]
    size = torch.Size([2, 3])
    md = Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(TensorProperties(torch.float32), size,
                                             [ChunkStorageMetadata(torch.Size([0, 0]), size)]),
            "optim.lr": BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "optim.lr": ("optim", "lr")},
        storage_data={MetadataIndex("model.w", torch.Size([0, 0]), 0): {"relative_path": "__0_0.distcp", "offset": 0, "length": 99}})
    return {
        "scalars": {"ints": [0, 1, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, 2**31, 2**40, -2**40, 2**63,
                             2**64, -(2**70), 10**100, -10**300], "f": [1.5, -0.0, float("inf"), 1e-300],
                    "none": None, "t": True, "f0": False},
        "strings": {"short": "x", "empty": "", "long": "y" * 300, "utf8": "\u00e9t\u00e9 \u043a\u043b\u044e\u0447 \U0001f600",
                    "bytes": b"\x00\xff\x80abc", "empty_bytes": b"", "long_bytes": bytes(range(256)) * 2},
        "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ((),), (("a",),)],
        "containers": {"set": {1, 2, 3}, "frozenset": frozenset({"a"}), "empty_set": set(), "od": collections.OrderedDict(a=1, b=[2]),
                       "nested": [[[[]]]], "dict_int_keys": {0: "a", 1: "b"}},
        "shared": {"a": shared_s, "b": shared_s, "l1": shared_l, "l2": shared_l, "t": (shared_l, shared_l)},
        "batching": {"list": list(range(2500)), "dict": {str(i): i for i in range(1500)}, "set": set(range(1200))},
        "torch": {"size": size, "size2": size, "empty_size": torch.Size([]), "dtype": torch.bfloat16,
                  "dtypes": [torch.float32, torch.float32, torch.int64], "layout": torch.strided,
                  "device": torch.device("cuda", 1), "cpu": torch.device("cpu")},
        "paths": [pathlib.PurePosixPath("/ck/step1")],
        "dcp_metadata": md,
        "large_frames": ["z" * 70000, b"q" * 70000, ["w%d" % i for i in range(12000)]],
    }


def test_byte_identical(protocol):
    def run():
        for name, obj in samples().items():
            src = os.path.join(work, f"{name}.p{protocol}")
            data = pickle.dumps(obj, protocol=protocol)
            open(src, "wb").write(data)
            out = src + ".ours"
            probe(a, "repickle", src, out, str(protocol))
            mine = open(out, "rb").read()
            if mine != data:
                at = next((i for i in range(min(len(mine), len(data))) if mine[i] != data[i]), min(len(mine), len(data)))
                raise AssertionError(f"{name}: differs at byte {at} (ours {len(mine)} bytes, CPython {len(data)}): "
                                     f"ours {mine[max(0, at - 8):at + 8]!r} vs {data[max(0, at - 8):at + 8]!r}")
            assert pickle.loads(mine) == pickle.loads(data) or name in ("dcp_metadata", "scalars")
    return run


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > " + os.path.join(work, "pwned"),))


def test_hostile_pickle_is_not_executed():
    src = os.path.join(work, "evil.p2")
    open(src, "wb").write(pickle.dumps({"x": Evil()}, protocol=2))
    out = src + ".ours"
    probe(a, "repickle", src, out, "2")  # read and written back as an opaque object, never run
    assert not os.path.exists(os.path.join(work, "pwned")), "the pickle ran"
    assert open(out, "rb").read() == open(src, "rb").read()


check("protocol 2: CPython bytes -> our tree -> identical bytes", test_byte_identical(2))
check("protocol 4: CPython bytes -> our tree -> identical bytes (frames, memoize, stack_global)", test_byte_identical(4))
check("protocol 5: identical bytes", test_byte_identical(5))
check("a hostile pickle is carried, never executed", test_hostile_pickle_is_not_executed)
finish()
