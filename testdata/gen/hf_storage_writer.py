# SPDX-License-Identifier: Apache-2.0
"""What torch.distributed.checkpoint's HuggingFaceStorageWriter leaves on disk, for torch 1.13
which has no such writer (docs/formats/dcp.md#hugging-face-storage). It follows, in this order:

* `torch/distributed/checkpoint/hf_storage.py`: HuggingFaceStorageWriter.prepare_global_plan (with
  save_sharded, plan i of the gathered plans, counted from 1, gets shard_index i) and write_data
  (items bucketed by fqn_to_index_mapping, or all in file 1; one file per bucket, named by
  `_hf_utils._gen_file_name`). With save_sharded and no consolidated_output_path, finish writes
  nothing more: no index, no .metadata.
* `torch/distributed/checkpoint/_hf_utils.py`: the names `shard-{rank:05}-model-{k:05}-of-{n:05}
  .safetensors` and `model-{k:05}-of-{n:05}.safetensors`; the metadata keys DCP_SHARDING_INFO
  (json.dumps of {fqn: {"saved_offsets": [...]}}), DCP_VERSION "1.0", format "pt".
* `filesystem.py` with SerializationFormat.SAFETENSORS: a file with no bytes items is one
  safetensors blob of its tensors with that __metadata__.
* the safetensors format (`huggingface/safetensors` safetensors/src/tensor.rs, `prepare` and
  `serialize`): tensors ordered by dtype alignment (largest first), then name; the header JSON
  compact, __metadata__ first, padded with spaces to a multiple of 8; data back to back.
A rank's chunk of a tensor is what DCP's planner saves for a DTensor placed Shard(0) (torch.chunk
of dim 0); a replicated tensor is saved once, by the first rank (dedup_save_plans)."""
import json
import os
import struct

ST_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
            "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def safetensors_bytes(torch, tensors, metadata):
    """safetensors.torch.save(tensors, metadata): `tensors` a dict name -> contiguous CPU tensor."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, body, at = {"__metadata__": metadata}, b"", 0
    for k in order:
        t = tensors[k].contiguous()
        flat = t.reshape(-1)
        data = bytes((flat.view(torch.uint8) if t.dtype != torch.bool else flat.to(torch.uint8)).numpy()) if t.numel() else b""
        header[k] = {"dtype": ST_NAMES[str(t.dtype).replace("torch.", "")], "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
        body += data
        at += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + body


def save_sharded(torch, state_dict, world, path, replicated=(), fqn_to_index_mapping=None, dedup=True):
    """dcp.save(state_dict, storage_writer=HuggingFaceStorageWriter(path, save_sharded=True, ...))
    from `world` ranks whose DTensors are state_dict's tensors placed Shard(0), but those named in
    `replicated`, which the first rank writes (every rank with dedup=False, as a planner without
    dedup_save_plans leaves it). Returns the files written."""
    os.makedirs(path, exist_ok=True)
    highest = max(fqn_to_index_mapping.values()) if fqn_to_index_mapping else 1
    written = []
    for rank in range(world):
        buckets = {}
        for fqn, full in state_dict.items():
            if fqn in replicated:
                if rank != 0 and dedup:
                    continue
                local, offsets = full, [0] * full.dim()
            else:
                pieces = torch.chunk(full, world, dim=0)
                if rank >= len(pieces):
                    continue
                row = sum(p.shape[0] for p in pieces[:rank])
                local, offsets = pieces[rank], [row] + [0] * (full.dim() - 1)
            index = fqn_to_index_mapping[fqn] if fqn_to_index_mapping else 1
            buckets.setdefault(index, {})[fqn] = (local, offsets)
        for index, items in sorted(buckets.items()):
            name = f"shard-{rank + 1:05d}-model-{index:05d}-of-{highest:05d}.safetensors"
            metadata = {"DCP_SHARDING_INFO": json.dumps({k: {"saved_offsets": o} for k, (_, o) in items.items()}),
                        "DCP_VERSION": "1.0", "format": "pt"}
            with open(os.path.join(path, name), "wb") as f:
                f.write(safetensors_bytes(torch, {k: t for k, (t, _) in items.items()}, metadata))
            written.append(name)
    return written


def read_as_hf_storage_reader(torch, path):
    """HuggingFaceStorageReader.read_metadata then read_data (hf_storage.py), into full tensors:
    every *.safetensors file of `path`; a tensor's chunks at their saved_offsets (0 without
    DCP_SHARDING_INFO); its size the furthest extent of its chunks."""
    dtypes = {v: getattr(torch, k) for k, v in ST_NAMES.items()}
    chunks, sizes, kinds = {}, {}, {}
    for f in sorted(os.listdir(path)):
        if not f.endswith(".safetensors"):
            continue
        data = open(os.path.join(path, f), "rb").read()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        meta = header.pop("__metadata__", {}) or {}
        info = json.loads(meta["DCP_SHARDING_INFO"]) if meta.get("DCP_SHARDING_INFO") else None
        for k, v in header.items():
            offsets = info[k]["saved_offsets"] if info is not None else [0] * len(v["shape"])
            b, e = v["data_offsets"]
            t = torch.frombuffer(bytearray(data[8 + n + b:8 + n + e]), dtype=dtypes[v["dtype"]]).reshape(v["shape"]) \
                if e > b else torch.empty(v["shape"], dtype=dtypes[v["dtype"]])
            chunks.setdefault(k, []).append((offsets, t))
            sizes[k] = [max(a, s + o) for a, s, o in zip(sizes.get(k, [0] * len(offsets)), v["shape"], offsets)]
            kinds[k] = dtypes[v["dtype"]]
    out = {}
    for k, pieces in chunks.items():
        full = torch.zeros(sizes[k], dtype=kinds[k])
        for offsets, t in pieces:
            view = full
            for d, (o, s) in enumerate(zip(offsets, t.shape)):
                view = view.narrow(d, o, s)
            view.copy_(t)
        out[k] = full
    return out


def consolidate(torch, input_dir, output_dir):
    """consolidate_safetensors_files(input_dir, output_dir) with no fqn_to_index_mapping, as
    torch/distributed/checkpoint/_consolidate_hf_safetensors.py writes it: one file,
    model-00001-of-00001.safetensors, its header json.dumps of {fqn: {"shape", "dtype",
    "data_offsets"}} (default separators, no __metadata__, no padding) in the order tensors are
    first met over the input files, each tensor's chunks copied into place by their saved offsets;
    then model.safetensors.index.json. Like the source, it takes an element's size from
    torch.finfo(dtype).bits, which raises for integer and bool dtypes."""
    dtypes = {v: getattr(torch, k) for k, v in ST_NAMES.items()}
    inputs = []
    for f in sorted(os.listdir(input_dir)):
        if not f.endswith(".safetensors"):
            continue
        data = open(os.path.join(input_dir, f), "rb").read()
        (n,) = struct.unpack("<Q", data[:8])
        inputs.append((json.loads(data[8:8 + n]), 8 + n, data))
    sizes = {}
    for header, _, _ in inputs:
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        for k, v in header.items():
            if k == "__metadata__":
                continue
            full = [s + o for s, o in zip(v["shape"], info[k]["saved_offsets"])]
            if k in sizes:
                full = [max(a, b) for a, b in zip(sizes[k][0], full)]
            sizes[k] = (full, v["dtype"])
    meta, at = {}, 0
    for k, (shape, dt) in sizes.items():
        size = torch.finfo(dtypes[dt]).bits // 8  # as the source: integer dtypes raise here
        end = at + size * (int(torch.tensor(shape).prod()) if shape else 1)
        meta[k] = {"shape": shape, "dtype": dt, "data_offsets": [at, end]}
        at = end
    head = json.dumps(meta).encode("utf-8")
    body = bytearray(at)
    for header, start, data in inputs:
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        for k, v in header.items():
            if k == "__metadata__":
                continue
            full, dt = sizes[k]
            b, e = v["data_offsets"]
            chunk = torch.frombuffer(bytearray(data[start + b:start + e]), dtype=dtypes[dt]).reshape(v["shape"]) if e > b else None
            if chunk is None:
                continue
            whole = torch.frombuffer(body, dtype=dtypes[dt], count=int(torch.tensor(full).prod()) if full else 1,
                                     offset=meta[k]["data_offsets"][0]).reshape(full)
            view = whole
            for d, (o, s) in enumerate(zip(info[k]["saved_offsets"], v["shape"])):
                view = view.narrow(d, o, s)
            view.copy_(chunk)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "model-00001-of-00001.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + bytes(body))
    total = sum(m["data_offsets"][1] - m["data_offsets"][0] for m in meta.values())
    with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in meta}}, f, indent=2)
