# --tensor shows a tensor's whole chunk grid (dim-1 chunks here) with files and byte ranges.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" ck
"$FSDP_CKPT_INSPECT" --tensor 'model.*.weight' ck
