# SPDX-License-Identifier: Apache-2.0
"""The Python side of the DCP tests: stand-ins for the torch 2.x DCP classes (for unpickling a 2.x
.metadata under torch 1.13), a reader that assembles every tensor from torch.load of its items the
way PyTorch's loader does, torch 1.13's own load_state_dict into full tensors, and torch's
set_element nesting (torch/distributed/checkpoint/_traverse.py) for dcp_to_torch_save's layout."""
import io
import os
import pickle
import sys
import types


def install_2x_stubs():
    """Stand-ins for the torch 2.x DCP classes (docs/formats/dcp.md#metadata) at their module paths."""
    if "torch.distributed.checkpoint.metadata" in sys.modules:
        return
    m = types.ModuleType("torch.distributed.checkpoint.metadata")
    f = types.ModuleType("torch.distributed.checkpoint.filesystem")
    import enum

    class Obj:
        def __setstate__(self, s):
            if isinstance(s, tuple):
                self.state_tuple = s
            else:
                self.__dict__.update(s)

        def __getstate__(self):  # pickled again as it came (TensorProperties' state is a tuple)
            return self.state_tuple if "state_tuple" in self.__dict__ else self.__dict__

    for name in ["Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                 "MetadataIndex", "StorageMeta"]:
        cls = type(name, (Obj,), {"__module__": m.__name__})
        setattr(m, name, cls)
    m._MEM_FORMAT_ENCODING = enum.Enum("_MEM_FORMAT_ENCODING", {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1,
                                                                "TORCH_PRESERVE_FORMAT": 2}, module=m.__name__)
    f._StorageInfo = type("_StorageInfo", (Obj,), {"__module__": f.__name__})
    sys.modules[m.__name__] = m
    sys.modules[f.__name__] = f


def rank_local(meta, rank):
    """NOTE [Rank-local metadata]: what rank `rank` of a use_collectives=False save writes to
    __{rank}.metadata, cut from the whole checkpoint's Metadata `meta` (changed in place): its
    storage_data items (those in its __{rank}_N files), the chunks and bytes entries they store,
    and their planner_data."""
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if v.relative_path.startswith(f"__{rank}_")}
    mine = {(k.fqn, tuple(k.offset) if getattr(k, "offset", None) is not None else None) for k in meta.storage_data}
    entries = {}
    for fqn, e in meta.state_dict_metadata.items():
        if hasattr(e, "chunks"):
            e.chunks = [c for c in e.chunks if (fqn, tuple(c.offsets)) in mine]
            if e.chunks:
                entries[fqn] = e
        elif (fqn, None) in mine:
            entries[fqn] = e
    meta.state_dict_metadata = entries
    if isinstance(getattr(meta, "planner_data", None), dict):
        meta.planner_data = {k: v for k, v in meta.planner_data.items() if k in entries}
    return meta


def python_read(torch, path):
    """Reads a DCP directory the way PyTorch's loader does: unpickle .metadata, torch.load each item."""
    meta = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    storage = {}
    for k, v in meta.storage_data.items():
        off = tuple(k.offset) if getattr(k, "offset", None) is not None else None
        storage[(k.fqn, off)] = v
    files = {}
    tensors, objects = {}, {}

    def item(info):
        data = files.setdefault(info.relative_path, open(os.path.join(path, info.relative_path), "rb").read())
        blob = data[info.offset:info.offset + info.length]
        if getattr(info, "transform_descriptors", None):
            import subprocess
            assert info.transform_descriptors == ["stream.zstd/1"], info.transform_descriptors
            blob = subprocess.run(["zstd", "-d", "-c"], input=blob, capture_output=True, check=True).stdout
        return io.BytesIO(blob)
    for fqn, entry in meta.state_dict_metadata.items():
        if type(entry).__name__ == "BytesStorageMetadata":
            objects[fqn] = torch.load(item(storage[(fqn, None)]))
            continue
        props = entry.properties
        dtype = props.dtype if hasattr(props, "dtype") else props.state_tuple[0]
        full = torch.zeros(tuple(entry.size), dtype=dtype)
        for ch in entry.chunks:
            t = torch.load(item(storage[(fqn, tuple(ch.offsets))]), weights_only=True)
            assert list(t.shape) == list(ch.sizes), f"{fqn}: item shape {t.shape} != chunk {ch.sizes}"
            view = full
            for d, (o, s) in enumerate(zip(ch.offsets, ch.sizes)):
                view = view.narrow(d, o, s)
            view.copy_(t)
        tensors[fqn] = full
    return tensors, objects




def load_113(torch, path):
    """PyTorch 1.13's own merge: load_state_dict(no_dist=True) into full, zeroed tensors."""
    from torch.distributed._shard.checkpoint import FileSystemReader
    return _load_113_by(torch, path, FileSystemReader(path).read_metadata())


def load_113_of_2x(torch, path):
    """PyTorch 1.13's own load_state_dict(no_dist=True) on a directory in torch 2.x's layout: the
    .metadata (read through the 2.x stand-ins) rebuilt field by field in 1.13's classes, then read
    by 1.13's FileSystemReader and default planner, whose _create_read_items takes the overlap of
    each saved chunk with each tensor asked for. Uncompressed items only."""
    from torch.distributed._shard.checkpoint import metadata as m
    from torch.distributed._shard.checkpoint.filesystem import _StorageInfo
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    meta = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    entries = {}
    for fqn, e in meta.state_dict_metadata.items():
        if type(e).__name__ == "BytesStorageMetadata":
            entries[fqn] = m.BytesStorageMetadata()
            continue
        props = e.properties
        dtype = props.dtype if hasattr(props, "dtype") else props.state_tuple[0]
        chunks = [m.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in e.chunks]
        entries[fqn] = m.TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(e.size), chunks)
    storage = {}
    for k, v in meta.storage_data.items():
        assert not getattr(v, "transform_descriptors", None), f"{k.fqn}: a transformed item"
        offset = getattr(k, "offset", None)
        storage[m.MetadataIndex(k.fqn, None if offset is None else list(offset), k.index)] = \
            _StorageInfo(v.relative_path, v.offset, v.length)
    return _load_113_by(torch, path, m.Metadata(state_dict_metadata=entries, storage_data=storage))


def _load_113_by(torch, path, metadata):
    """1.13's load_state_dict(no_dist=True) of the directory `path` as `metadata` (1.13's classes)
    describes it, into full, zeroed tensors (None for a bytes entry)."""
    from torch.distributed._shard.checkpoint import FileSystemReader, load_state_dict
    from torch.distributed._shard.checkpoint.metadata import TensorStorageMetadata

    class Reader(FileSystemReader):
        def read_metadata(self):
            return metadata
    sd = {fqn: torch.zeros(tuple(e.size), dtype=e.properties.dtype) if isinstance(e, TensorStorageMetadata) else None
          for fqn, e in metadata.state_dict_metadata.items()}
    load_state_dict(sd, Reader(path), no_dist=True)
    return sd


def set_element(root, path, value):
    """torch.distributed.checkpoint._traverse.set_element, as dcp_to_torch_save nests entries."""
    cur = root

    def extend(lst, idx):
        while len(lst) <= idx:
            lst.append(None)
    for i in range(1, len(path)):
        prev, key = path[i - 1], path[i]
        default = {} if type(key) == str else []
        if isinstance(cur, dict):
            cur = cur.setdefault(prev, default)
        else:
            extend(cur, prev)
            if cur[prev] is None:
                cur[prev] = default
            cur = cur[prev]
    key = path[-1]
    if type(key) == int:
        extend(cur, key)
    cur[key] = value


def dcp_to_torch_save(torch, path):
    """What dcp_to_torch_save produces for a DCP directory (docs/formats/dcp.md#dcp_to_torch_save), in Python: every
    entry in state_dict_metadata order, nested by planner_data, bytes items unpickled."""
    meta = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    tensors, objects = python_read(torch, path)
    planner = getattr(meta, "planner_data", None) or {}
    out = {}
    for fqn in meta.state_dict_metadata:
        value = tensors[fqn] if fqn in tensors else objects[fqn]
        set_element(out, list(planner.get(fqn, (fqn,))), value)
    return out


def same(torch, a, b, where="root"):
    """Deep equality with dict key order, dtypes and tensor bytes; raises AssertionError naming the path."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        va = a.contiguous().reshape(-1).view(torch.uint8) if a.dtype != torch.bool else a.contiguous().to(torch.uint8)
        vb = b.contiguous().reshape(-1).view(torch.uint8) if b.dtype != torch.bool else b.contiguous().to(torch.uint8)
        assert bytes(va.numpy()) == bytes(vb.numpy()), f"{where}: tensor bytes differ"
        return
    assert type(a) == type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a.keys())} vs {list(b.keys())}"
        for k in a:
            same(torch, a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(torch, x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"
