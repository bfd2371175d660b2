# SPDX-License-Identifier: Apache-2.0
"""fsdp-tools from Python: open, inspect, read and verify any checkpoint the tools read (DCP
directories of torch 1.13 to 2.x, torch.save files, safetensors files and folders, HDF5), without
torch and without running the checkpoint's pickles.

    import fsdp_tools
    ckpt = fsdp_tools.open("checkpoints/step-1000")
    ckpt.format, ckpt.world_size, len(ckpt)
    for e in ckpt.entries: print(e["name"], e.get("dtype"), e.get("shape"))
    w = ckpt.tensor("model.embed.weight")        # a numpy array, read from its bytes alone
    problems = fsdp_tools.verify("checkpoints/step-1000", deep=True)

Every failure caused by the checkpoint raises CheckpointError, naming the file and byte offset.
"""
import json as _json
import os as _os
import sys as _sys

# libckpt's HDF5 support is a module it loads on first use (so that libhdf5 is loaded only then),
# which takes libckpt's own functions from the program that loads it: _native's symbols are made
# global for that.
_flags = _sys.getdlopenflags()
_sys.setdlopenflags(_flags | _os.RTLD_GLOBAL)
try:
    from . import _native
finally:
    _sys.setdlopenflags(_flags)

__all__ = ["CheckpointError", "Checkpoint", "open", "verify", "diff", "stats", "merge", "shard"]


class CheckpointError(Exception):
    """A checkpoint that could not be read or used: `path` (the file or item read), `offset` (the
    byte offset in it, or None), `message` (what was wrong), `kind` ("format", "io",
    "unsupported", "mismatch", "invalid_argument", ...)."""

    def __init__(self, text, path="", offset=None, message="", kind=""):
        super().__init__(text)
        self.path = path
        self.offset = offset
        self.message = message or text
        self.kind = kind


_native._set_error_class(CheckpointError)


class Checkpoint:
    """An open checkpoint: its index, read from its metadata alone. Tensors are read when asked for.

    Attributes: path, format ("dcp", "torch_save", "safetensors", "hdf5", ...), writer (what wrote
    it, as far as it shows), world_size (DCP: the ranks whose files it names; else None), files
    (each {"path", "size"}), entries (each {"name", "kind", ...}: a tensor's dtype, shape, nbytes
    and chunks, each with its file and byte range; as `fsdp-ckpt-inspect --json` lists them), and
    metadata (the metadata trees, meta.pt and the like, as plain Python values: an object of a
    class is a dict naming its class). `len(ckpt)`, `name in ckpt` and iteration go by entry name.
    """

    def __init__(self, path):
        self._native = _native.Checkpoint(str(path))
        self._described = None
        self._metadata = None

    def _description(self):
        if self._described is None:
            self._described = _json.loads(self._native.describe(False))
        return self._described

    @property
    def path(self):
        """The path it was opened from."""
        return self._native.path

    @property
    def format(self):
        """The format: "dcp", "torch_save", "safetensors", "hdf5", ... (as fsdp-ckpt-inspect names it)."""
        return self._description()["format"]

    @property
    def writer(self):
        """What wrote it, as far as it shows (a torch version, Lightning, Megatron, ...), or None."""
        return self._description()["writer"]

    @property
    def world_size(self):
        """DCP: the number of ranks whose files it names; None for a single-file format."""
        return self._description()["world_size"]

    @property
    def files(self):
        """Its files, each {"path", "size"}."""
        return self._description()["files"]

    @property
    def entries(self):
        """Its entries in order, each {"name", "kind", ...}: a tensor's dtype, shape, nbytes and chunks (file and byte
        range each), as `fsdp-ckpt-inspect --json` lists them."""
        return self._description()["entries"]

    @property
    def metadata(self):
        """Its metadata trees (DCP's .metadata beyond the tensors, meta.pt, ...) as plain Python values: an
        object of a class is a dict naming its module, name and args. Read on first use."""
        if self._metadata is None:
            described = _json.loads(self._native.describe(True))
            self._metadata = dict(described.get("meta_json", {}))
            self._metadata.update(described.get("metadata", {}))
        return self._metadata

    def __len__(self):
        return len(self._native)

    def __iter__(self):
        return iter(self._native.names())

    def __contains__(self, name):
        return self._native.contains(name)

    def verify(self, deep=False):
        """Every problem verify() finds in this checkpoint (read again from its path), as a list of
        dicts {"path", "offset", "message"}; empty when sound."""
        return verify(self.path, deep)

    def tensor(self, name, float32=False, torch=False):
        """The whole tensor `name` as a numpy array, read from the bytes that hold it alone.

        A dtype numpy lacks (bfloat16, the float8 kinds) comes as its bit patterns in an unsigned
        integer array of its width; float32=True casts it to float32 instead. torch=True gives a
        torch tensor of the checkpoint's own dtype (torch must be importable). Raises
        CheckpointError for a name that is not a tensor, and for unreadable bytes."""
        array, dtype = self._native.tensor(name, bool(float32) and not torch)
        if not torch:
            return array
        import torch as _torch

        if array.dtype.kind == "u" and array.itemsize > 1:  # bit patterns: torch has no wide unsigned types
            array = array.view(f"<i{array.itemsize}")
        t = _torch.from_numpy(array)
        own = getattr(_torch, dtype, None)
        if own is not None and t.dtype != own and t.element_size() == _torch.empty((), dtype=own).element_size():
            t = t.view(own)
        return t

    def __repr__(self):
        return f"fsdp_tools.Checkpoint({self.path!r}, format={self.format!r}, entries={len(self)})"


def open(path):  # noqa: A001 (the module's own open, as tarfile.open)
    """Opens any checkpoint the tools read; raises CheckpointError naming the file and offset."""
    return Checkpoint(path)


def verify(path, deep=False):
    """Every problem `fsdp-ckpt-inspect verify` finds, as a list of dicts {"path", "offset",
    "message"} (empty: sound). deep=True also reads every byte, checking recorded CRC-32s. A path
    that cannot be opened as a checkpoint is one problem, not an exception."""
    return [{"path": s, "offset": o, "message": m} for s, o, m in _native.verify(str(path), bool(deep))]


def _command_line(options, flags=(), lists=()):
    """Keyword arguments as the tool's options: name=value as --name VALUE, a true flag as --name,
    a list as the option repeated."""
    args = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        opt = "--" + name.replace("_", "-")
        if name in flags:
            args.append(opt)
        elif name in lists:
            for v in [value] if isinstance(value, str) else value:
                args += [opt, str(v)]
        else:
            args += [opt, str(value)]
    return args


def _run(native, args, *rest):
    import re

    try:
        return _json.loads(native(args, *rest))
    except ValueError as e:
        if isinstance(e, _json.JSONDecodeError):
            raise
        # The tool's option names as this module's keyword arguments.
        raise ValueError(re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_"), str(e))) from None


_MERGE_FLAGS = ("model_only", "strict_cast", "hf_config", "force", "verify", "dry_run")
_MERGE_LISTS = ("cast_include", "include", "exclude", "rename")


def merge(src, dst=None, *, format=None, layout=None, key=None, dtype=None, cast_include=(), strict_cast=False,  # noqa: A002
          include=(), exclude=(), model_only=False, max_shard_size=None, rename=(), strip_prefix=None, hf_config=False,
          force=False, verify=False, threads=None, dry_run=False, progress=None):
    """`fsdp-ckpt-merge SRC -o DST ...` in this process, with the same options and defaults: one
    full file (torch.save; safetensors, or Hugging Face shards in a directory with max_shard_size;
    HDF5), written atomically. format: "torch", "safetensors" or "hdf5" (default: DST's extension,
    else torch); dst default: SRC.consolidated. include and exclude (globs over FQNs) apply
    includes first, then excludes; rename: "s/REGEX/REPLACEMENT/" strings, in order; hf_config:
    Hugging Face's config.json beside a safetensors output (inside a max_shard_size directory),
    for an fsdp-train --model llama checkpoint, listed among the files written. progress:
    called as progress(bytes_done, bytes_total) at most every 0.1 s; if it raises, the merge stops,
    nothing is left behind, and the exception propagates. Ctrl-C stops it the same way.

    Returns what `fsdp-ckpt-merge --json` prints, as a dict. Raises CheckpointError for bad input
    (nothing written), ValueError for options that do not fit (as the tool's usage errors)."""
    args = [str(src)] + (["-o", str(dst)] if dst is not None else [])
    args += _command_line(dict(format=format, layout=layout, key=key, dtype=dtype, cast_include=cast_include, strict_cast=strict_cast,
                               include=include, exclude=exclude, model_only=model_only, max_shard_size=max_shard_size, rename=rename,
                               strip_prefix=strip_prefix, hf_config=hf_config, force=force, verify=verify, threads=threads,
                               dry_run=dry_run),
                          _MERGE_FLAGS, _MERGE_LISTS)
    return _run(_native.merge, args, progress)


def shard(src, dst, world_size, *, layout=None, format=None, replicate=(), files_per_rank=None, compress=None,  # noqa: A002
          dtype=None, cast_include=(), strict_cast=False, key=None, max_memory=None, include=(), exclude=(), rename=(),
          strip_prefix=None, force=False, verify=False, threads=None, dry_run=False, progress=None):
    """`fsdp-ckpt-shard SRC -o DST -n WORLD_SIZE ...` in this process, with the same options and
    defaults: a DCP directory (or, format="hf-safetensors", DCP's safetensors layout) for
    world_size ranks, which PyTorch's dcp.load reads at any world size. layout: "fsdp" (dim-0
    torch.chunk pieces) or "dtensor"; compress: "zstd" or "zstd:LEVEL"; key: put a non-DCP input's
    entries under this top-level key ("model"). progress, errors and the result as merge()'s."""
    args = [str(src), "-o", str(dst), "-n", str(world_size)]
    args += _command_line(dict(layout=layout, format=format, replicate=replicate, files_per_rank=files_per_rank, compress=compress,
                               dtype=dtype, cast_include=cast_include, strict_cast=strict_cast, key=key, max_memory=max_memory,
                               include=include, exclude=exclude, rename=rename, strip_prefix=strip_prefix, force=force,
                               verify=verify, threads=threads, dry_run=dry_run),
                          _MERGE_FLAGS, _MERGE_LISTS + ("replicate",))
    return _run(_native.shard, args, progress)


def diff(a, b, *, rtol=0.0, atol=0.0, include=(), exclude=(), model_only=False, key=None, map_prefix=()):
    """`fsdp-ckpt-inspect diff A B --json`: two checkpoints of any formats and layouts compared as
    merge reads them, per tensor the max-abs and max-rel difference (in float64). Returns its
    report as a dict; report["equal"] says whether they agree within rtol and atol. include and
    exclude select A's entries (includes first); map_prefix: "FROM=TO" strings."""
    args = ["diff", str(a), str(b), "--json"]
    args += _command_line(dict(rtol=rtol, atol=atol, include=include, exclude=exclude, model_only=model_only, key=key,
                               map_prefix=map_prefix), ("model_only",), ("include", "exclude", "map_prefix"))
    return _run(_native.inspect, args)


def stats(path, *, tensor=None, threads=None):
    """`fsdp-ckpt-inspect stats PATH --json`: per tensor (those matching the glob `tensor`) min,
    max, mean, std, max-abs and the NaN and Inf counts, reading each chunk once. A dict."""
    return _run(_native.inspect, ["stats", str(path), "--json"] + _command_line(dict(tensor=tensor, threads=threads)))
