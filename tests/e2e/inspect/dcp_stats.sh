cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" ck
"$FSDP_CKPT_INSPECT" stats -j 2 ck
