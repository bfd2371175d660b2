# -q prints errors only, in every tool (as zstd -q): a merge and a shard that succeed print
# nothing; a plan (--dry-run) and --json still print, being what was asked for; an error prints.
in="$FSDP_TESTDATA_DIR/dcp/torch113_2rank"
"$FSDP_CKPT_MERGE" -q "$in" -o m.pt
"$FSDP_CKPT_SHARD" -q "$in" -o s -n 3
"$FSDP_CKPT_MERGE" -q "$in" -o d.pt --dry-run | grep -q 'd.pt' || echo "-q --dry-run printed no plan"
"$FSDP_CKPT_MERGE" -q "$in" -o j.pt --json | grep -q '"files"' || echo "-q --json printed no JSON"
"$FSDP_CKPT_MERGE" -q "$in" -o m.pt 2>&1 | grep -q 'fsdp-ckpt-merge: error: ' || echo "-q hid an error"
exit 0
