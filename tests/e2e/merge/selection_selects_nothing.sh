# A selection that selects nothing writes nothing, exit 1, naming the filters that matched no
# entry; a filter that matched nothing beside others that did is named in a note (issue 28 item 5).
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" in
"$FSDP_CKPT_MERGE" -q in -o none.pt --include 'nomatch*'
echo "exit $?"
"$FSDP_CKPT_MERGE" in -o some.pt --include 'nomatch*' --include 'model.*' >/dev/null
echo "exit $?"
"$FSDP_CKPT_SHARD" -q in -o none -n 2 --exclude '*'
echo "exit $?"
"$FSDP_CKPT_INSPECT" in --tensor 'nomatch*'
echo "exit $?"
"$FSDP_CKPT_INSPECT" stats in --tensor 'nomatch*'
echo "exit $?"
ls
