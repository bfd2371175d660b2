# SPDX-License-Identifier: Apache-2.0
"""Lets Debian's torch 1.13 import torch.distributed._shard on Python 3.11.

Python 3.11's dataclasses refuse an unhashable default (torch's ShardedTensorMetadata uses a
TensorProperties() instance as one). This patch, applied in the generator's and the test
harness's own process only (never in the product), retries such a field with the default's
class made hashable for the duration of the check."""
import dataclasses

_orig_get_field = dataclasses._get_field


def _get_field(cls, a_name, a_type, *args):
    try:
        return _orig_get_field(cls, a_name, a_type, *args)
    except ValueError as e:
        if "mutable default" not in str(e):
            raise
        default = cls.__dict__.get(a_name)
        if isinstance(default, dataclasses.Field):
            default = default.default
        t = type(default)
        saved = t.__dict__.get("__hash__")
        t.__hash__ = object.__hash__
        try:
            return _orig_get_field(cls, a_name, a_type, *args)
        finally:
            t.__hash__ = saved


dataclasses._get_field = _get_field
