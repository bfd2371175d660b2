# --dry-run prints the plan of the 4-rank fixture for 3 ranks (chunks by torch.chunk's rule,
# replicated tensors and bytes items placed by DCP's deduplication) and writes nothing.
"$FSDP_CKPT_SHARD" "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" -o out -n 3 --dry-run
status=$?
ls
exit $status
