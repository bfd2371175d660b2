# --force replaces a file, an empty directory or an output of the kind being written, nothing else:
# a directory holding anything else is refused, named, and left as it was (issue 28 item 1).
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" in
mkdir -p shards/keep && echo mine > shards/keep/file.txt
"$FSDP_CKPT_MERGE" -q in -o shards --max-shard-size 1kB -f
echo "exit $?"
cat shards/keep/file.txt
mkdir hf && echo '{}' > hf/config.json
"$FSDP_CKPT_MERGE" -q in -o hf --max-shard-size 1kB -f
echo "exit $?"
ls hf
mkdir full && echo x > full/notes.txt
"$FSDP_CKPT_MERGE" -q in -o full -f
echo "exit $?"
ls full
# what may be replaced: an earlier shard set, an empty directory, a file
"$FSDP_CKPT_MERGE" -q in -o set --max-shard-size 1kB >/dev/null && "$FSDP_CKPT_MERGE" -q in -o set --max-shard-size 4kB -f >/dev/null
echo "exit $?"
ls set
mkdir empty && "$FSDP_CKPT_MERGE" -q in -o empty -f >/dev/null
echo "exit $? $( [[ -f empty ]] && echo file)"
