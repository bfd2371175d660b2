# Usage errors exit 2: --key with torch output, an unknown --dtype, -o without its value.
"$FSDP_CKPT_MERGE" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out.pt --key model
echo "exit $?"
"$FSDP_CKPT_MERGE" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o out.pt --dtype int8 2>/dev/null
echo "exit $?"
"$FSDP_CKPT_MERGE" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o 2>/dev/null
echo "exit $?"
ls
