# --dry-run prints the plan of the 4-rank fixture and writes nothing.
"$FSDP_CKPT_MERGE" "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" -o out.pt --dry-run
status=$?
ls
exit $status
