# Shard the 2-rank fixture to 3 ranks (plain and zstd, two files per rank) and the merged file back
# to 4 ranks in the DTensor layout: each output passes verify --deep and diffs equal to its source.
set -e
"$FSDP_CKPT_SHARD" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o w3 -n 3 >/dev/null
"$FSDP_CKPT_INSPECT" verify --deep w3
"$FSDP_CKPT_INSPECT" diff "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" w3
"$FSDP_CKPT_SHARD" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o w3z -n 3 --compress zstd --files-per-rank 2 >/dev/null
"$FSDP_CKPT_INSPECT" verify --deep w3z
"$FSDP_CKPT_MERGE" -q w3z -o full.pt >/dev/null
"$FSDP_CKPT_SHARD" -q full.pt -o w4 -n 4 --layout dtensor >/dev/null
"$FSDP_CKPT_INSPECT" verify --deep w4
"$FSDP_CKPT_INSPECT" diff full.pt w4
"$FSDP_CKPT_INSPECT" --tensor model.embed.weight w4 | tail -5
ls -A w3 w3z w4
