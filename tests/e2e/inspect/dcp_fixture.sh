# A DCP checkpoint written by torch 1.13 from 4 Gloo ranks: summary and table.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" ck
"$FSDP_CKPT_INSPECT" ck
