# A .distcp missing from the middle: exit 1, the file named, nothing written.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" ck
rm ck/__2_0.distcp
"$FSDP_CKPT_MERGE" ck -o out.pt
status=$?
ls
exit $status
