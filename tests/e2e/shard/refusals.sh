# An existing output is refused without --force and kept; --force does not replace a directory that
# holds other files (force_replaces_only_outputs has what it does replace). The output may never be
# the input or hold it. Nothing is left behind.
mkdir out && echo keep > out/file
"$FSDP_CKPT_SHARD" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out -n 2
echo "exit $?"
ls -A out
"$FSDP_CKPT_SHARD" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out -n 2 --force >/dev/null
echo "exit $?"
ls -A out
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" ck
"$FSDP_CKPT_SHARD" ck -o ck -n 3 --force
echo "exit $?"
"$FSDP_CKPT_SHARD" ck -o . -n 3 --force
echo "exit $?"
ls -A
