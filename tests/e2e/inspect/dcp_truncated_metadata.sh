cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" ck
head -c 700 "$FSDP_TESTDATA_DIR/dcp/torch113_2rank/.metadata" > ck/.metadata
"$FSDP_CKPT_INSPECT" ck
