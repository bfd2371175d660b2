# An output name that says otherwise than what is written is a usage error (exit 2), and nothing
# is written; without -o, merge writes INPUT.consolidated (Lightning's name), a torch.save file.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" in
mkdir d
"$FSDP_CKPT_MERGE" -q in -o d/
echo "exit $?"
"$FSDP_CKPT_MERGE" -q in -o t.pt --max-shard-size 5GB
echo "exit $?"
"$FSDP_CKPT_MERGE" -q in -o x.safetensors --format torch
echo "exit $?"
"$FSDP_CKPT_SHARD" -q in -o w.pt -n 2
echo "exit $?"
ls
"$FSDP_CKPT_MERGE" -q in/
echo "exit $?"
"$FSDP_CKPT_INSPECT" --summary in.consolidated | head -1
"$FSDP_CKPT_MERGE" -q in --format safetensors
echo "exit $?"
# A trailing '/' on the input keeps its name as the output's source.
"$FSDP_CKPT_MERGE" -q in/ -o s.safetensors && grep -a -o '"source":"[^"]*"' s.safetensors
