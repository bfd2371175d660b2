# A missing data file and a truncated one: verify reports every problem, exit 1.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" ck
rm ck/__3_0.distcp
head -c 1000 "$FSDP_TESTDATA_DIR/dcp/torch113_4rank/__1_0.distcp" > ck/__1_0.distcp
"$FSDP_CKPT_INSPECT" verify ck
