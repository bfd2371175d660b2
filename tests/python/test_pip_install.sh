#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `pip install --no-build-isolation .` as a user runs it, with no network (--no-index): a copy of
# the source tree (the files git tracks, or the tree without its build folders) is installed into
# a fresh directory, the copy is removed, and the installed package passes the module's own test
# (test_fsdp_tools.py) from a directory outside the tree: the extension, its Python files and the
# HDF5 module all came from the wheel.
# Usage: test_pip_install.sh SOURCE_DIR INSPECT MERGE
set -euo pipefail
src=$1 inspect=$2 merge=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/fsdp-pip-XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$src" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work/src")
else
  (cd "$src" && tar --exclude='./build*' --exclude=./.cache --exclude=./.git -cf - .) | tar -xf - -C "$work/src"
fi
/usr/bin/python3 -m pip install --no-build-isolation --no-index --no-deps --disable-pip-version-check \
  --root-user-action=ignore --target "$work/site" "$work/src" >"$work/pip.log" 2>&1 ||
  { tail -n 60 "$work/pip.log"; echo "FAIL: pip install of the source tree"; exit 1; }
rm -rf "$work/src"
for f in _native.cpython-*.so __init__.py __init__.pyi py.typed libckpt_hdf5.so; do
  compgen -G "$work/site/fsdp_tools/$f" >/dev/null || { echo "FAIL: the installed package has no $f"; exit 1; }
done
cd "$work"
/usr/bin/python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import fsdp_tools, importlib.metadata as m
assert fsdp_tools.__file__.startswith(sys.argv[1]), fsdp_tools.__file__
print("installed", m.version("fsdp-tools"), "at", fsdp_tools.__file__)' "$work/site"
/usr/bin/python3 "$src/tests/python/test_fsdp_tools.py" --python-dir "$work/site" --inspect "$inspect" --merge "$merge" \
  --testdata "$src/testdata"
