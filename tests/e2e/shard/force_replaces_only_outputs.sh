# --force replaces a DCP directory (even one a killed save left without .metadata), a file or an
# empty directory; a directory holding anything else is refused, named, and left as it was.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" in
mkdir -p out/keep && echo mine > out/keep/file.txt
"$FSDP_CKPT_SHARD" -q in -o out -n 2 -f
echo "exit $?"
cat out/keep/file.txt
"$FSDP_CKPT_SHARD" -q in -o dcp -n 2 >/dev/null && rm dcp/.metadata && "$FSDP_CKPT_SHARD" -q in -o dcp -n 3 -f >/dev/null
echo "exit $?"
ls -A dcp
echo x > file && "$FSDP_CKPT_SHARD" -q in -o file -n 1 -f >/dev/null
echo "exit $?"
ls -A file
