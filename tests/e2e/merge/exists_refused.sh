# An existing output is refused without --force and kept; --force replaces it.
echo keep > out.pt
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out.pt
echo "exit $?"
cat out.pt
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out.pt --force >/dev/null
echo "exit $?"
ls
