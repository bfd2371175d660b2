# --help of every tool and subcommand shows each option's default (issue 33), never a placeholder:
# no "=0" or "=-1" stuck to a type, no default beside a required option; and the defaults named.
for tool in FSDP_CKPT_INSPECT FSDP_CKPT_MERGE FSDP_CKPT_SHARD; do
  helps=$("${!tool}" --help)
  for sub in verify stats diff; do [[ $tool == FSDP_CKPT_INSPECT ]] && helps+=$'\n'$("${!tool}" "$sub" --help); done
  if grep -E -- '(INT|FLOAT|TEXT|UINT)[^ ]*=|\(required\).*\(default:' <<<"$helps"; then echo "$tool: a placeholder or a required option's default"; exit 1; fi
done
"$FSDP_CKPT_SHARD" --help | grep -q -- '--layout {fsdp,dtensor} .*(default: fsdp)' || { echo "shard --layout: no default"; exit 1; }
"$FSDP_CKPT_SHARD" --help | grep -q -- '--max-memory TEXT .*(default: 1GiB)' || { echo "shard --max-memory: no default"; exit 1; }
"$FSDP_CKPT_SHARD" --help | grep -q -- '--timeout FLOAT .*\[> 0\] (default: 1800)' || { echo "shard --timeout: no default"; exit 1; }
"$FSDP_CKPT_SHARD" --help | grep -q -- '--files-per-rank INT .*\[1 - 1024\] (default: 1)' || { echo "shard --files-per-rank: no default"; exit 1; }
"$FSDP_CKPT_SHARD" --help | grep -q -- '--compress TEXT .*zstd (level 3)' || { echo "shard --compress: no level"; exit 1; }
"$FSDP_CKPT_MERGE" --help | grep -q -- '--layout {nested,flat} .*(default: nested)' || { echo "merge --layout: no default"; exit 1; }
if "$FSDP_CKPT_MERGE" --help | grep -- '-j,--threads.*(default: 0)'; then echo "merge -j: a placeholder default"; exit 1; fi
exit 0
