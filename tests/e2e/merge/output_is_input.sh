# Even with --force, the output may not be the input or a directory holding it: replacing it
# would remove the checkpoint being read. The input is left whole.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" ck
"$FSDP_CKPT_MERGE" ck -o ck --max-shard-size 1GB --force
echo "exit $?"
"$FSDP_CKPT_MERGE" ck -o . --max-shard-size 1GB --force
echo "exit $?"
ls -A ck
