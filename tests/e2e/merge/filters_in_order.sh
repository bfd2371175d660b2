# --include/--exclude apply in the order given (also as --exclude=GLOB), each taking one value, so
# the positional INPUT may follow them.
"$FSDP_CKPT_MERGE" --exclude='optim.*' --include 'optim.state.*' --exclude '*.step' "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" \
  -o out.pt --dry-run
