# --summary prints the summary alone; past 8 data files it counts them in one line and still
# lists .metadata; --files lists them all, --bytes gives exact sizes; --summary with --tensor is
# a usage error.
"$FSDP_CKPT_SHARD" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o w12 -n 12 || exit 1
"$FSDP_CKPT_INSPECT" --summary w12
"$FSDP_CKPT_INSPECT" --summary --files --bytes w12 | grep -c '^file: .*distcp ([0-9]* bytes)$'
"$FSDP_CKPT_INSPECT" --summary --tensor 'model.*' w12
echo "exit $?"
