# A save that died before committing: .metadata.tmp but no .metadata.
mkdir ck && cp "$FSDP_TESTDATA_DIR/dcp/torch113_2rank/__0_0.distcp" ck/ && touch ck/.metadata.tmp
"$FSDP_CKPT_INSPECT" ck
