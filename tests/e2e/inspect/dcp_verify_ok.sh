cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" ck
"$FSDP_CKPT_INSPECT" verify --deep ck
