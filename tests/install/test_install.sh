#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# cmake --install into a temporary prefix: the installed tools run (version, a merge, an inspect),
# `man -l` renders every installed page, and the installed bash completion completes an option,
# a subcommand and a subcommand's option (the zsh one is a #compdef file for each tool); the
# installed Python module imports and merges to HDF5 and reads it back.
# Usage: test_install.sh BUILD_DIR TESTDATA_DIR
set -u
build=$1 testdata=$2
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
cmake --install "$build" --prefix "$prefix" >/dev/null || fail "cmake --install"
tools=(fsdp-ckpt-inspect fsdp-ckpt-merge fsdp-ckpt-shard)
[[ -x $build/tools/fsdp-train ]] && tools+=(fsdp-train)
for t in "${tools[@]}"; do
  "$prefix/bin/$t" --version | grep -q "^$t " || fail "$t --version"
  page=$prefix/share/man/man1/$t.1
  [[ -f $page ]] || fail "no man page $page"
  MANWIDTH=80 man -l -P cat "$page" 2>/dev/null | grep -q "^NAME" || fail "man -l $page"
  [[ -f $prefix/share/bash-completion/completions/$t ]] || fail "no bash completion for $t"
  head -1 "$prefix/share/zsh/site-functions/_$t" | grep -qx "#compdef $t" || fail "no zsh completion for $t"
done
err=$("$prefix/bin/fsdp-ckpt-inspect" --completion fish 2>&1 >/dev/null)
[[ $? == 2 && $err == "fsdp-ckpt-inspect: error: --completion: fish not in {bash,zsh}"* ]] || fail "--completion fish: '$err'"
work=$(mktemp -d)
"$prefix/bin/fsdp-ckpt-merge" -q "$testdata/dcp/torch113_2rank" -o "$work/m.pt" || fail "the installed merge"
"$prefix/bin/fsdp-ckpt-inspect" verify -q "$work/m.pt" >/dev/null || fail "the installed inspect"
# The Python module, where it was installed, without the build tree on its path.
if [[ -f $build/python/fsdp_tools/__init__.py ]]; then
  PYTHONPATH=$prefix/lib/python3/dist-packages /usr/bin/python3 -c "
import sys, fsdp_tools
assert fsdp_tools.__file__.startswith('$prefix'), fsdp_tools.__file__
r = fsdp_tools.merge('$testdata/dcp/torch113_2rank', '$work/py.h5')
c = fsdp_tools.open('$work/py.h5')
assert c.format == 'hdf5' and len(c) > 0 and c.tensor('model.embed.weight').shape == (10, 4), c
" || fail "the installed Python module"
fi
rm -rf "$work"
# Completion, as bash calls it: COMP_WORDS and COMP_CWORD set, the function's COMPREPLY read.
source "$prefix/share/bash-completion/completions/fsdp-ckpt-inspect"
complete_words() {
  COMP_WORDS=("$@")
  COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
  COMPREPLY=()
  _fsdp_ckpt_inspect_complete
  echo "${COMPREPLY[*]}"
}
[[ $(complete_words fsdp-ckpt-inspect --js) == --json ]] || fail "an option: '$(complete_words fsdp-ckpt-inspect --js)'"
[[ $(complete_words fsdp-ckpt-inspect ver) == verify ]] || fail "a subcommand: '$(complete_words fsdp-ckpt-inspect ver)'"
[[ $(complete_words fsdp-ckpt-inspect verify --de) == --deep ]] || fail "a subcommand's option: '$(complete_words fsdp-ckpt-inspect verify --de)'"
[[ -z $(complete_words fsdp-ckpt-inspect verify --met) ]] || fail "the top level's --meta offered after verify"
echo "installed ${#tools[@]} tools, their man pages and completions; bash completes options and subcommands"
