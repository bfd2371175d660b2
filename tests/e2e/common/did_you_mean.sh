# A mistyped option or subcommand is named with what was most likely meant; exit 2.
"$FSDP_CKPT_MERGE" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out.pt --dtpye bf16
echo "exit $?"
"$FSDP_CKPT_SHARD" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out --wrold-size 2
echo "exit $?"
"$FSDP_CKPT_INSPECT" verfiy "$FSDP_TESTDATA_DIR/dcp/torch113_2rank"
echo "exit $?"
ls
