# A merge's Hugging Face output folder is an input like any checkpoint: inspected, and diffed
# against the checkpoint it came from (the folder's index read through the folder).
"$FSDP_CKPT_MERGE" "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o hf --max-shard-size 100B -q
"$FSDP_CKPT_INSPECT" hf | head -3
"$FSDP_CKPT_INSPECT" diff "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" hf | head -1
