# Usage errors exit 2: no --world-size, a bad --compress, --world-size 0, a RANK past WORLD_SIZE.
"$FSDP_CKPT_SHARD" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out 2>/dev/null
echo "exit $?"
"$FSDP_CKPT_SHARD" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out -n 2 --compress lz4
echo "exit $?"
"$FSDP_CKPT_SHARD" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out -n 0 2>/dev/null
echo "exit $?"
RANK=2 WORLD_SIZE=2 "$FSDP_CKPT_SHARD" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out -n 2
echo "exit $?"
"$FSDP_CKPT_SHARD" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out -n 2 --key model
echo "exit $?"
ls
