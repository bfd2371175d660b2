# A merged file against its sharded source: every tensor and every non-tensor leaf equal (the
# bytes items are compared leaf by leaf with the merged file's tree), exit 0.
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" -o merged.pt >/dev/null || exit 1
"$FSDP_CKPT_INSPECT" diff "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" merged.pt
