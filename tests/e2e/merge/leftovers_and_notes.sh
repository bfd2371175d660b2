# A temporary file that a killed merge left beside the output is removed by the next merge to that
# output, which says so (issue 28 item 4); a safetensors output says what it leaves out (item 7).
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" in
sleep 300 & dead=$!
kill -9 $dead; wait $dead 2>/dev/null
head -c 1000 /dev/zero > "out.pt.tmp.$dead"
"$FSDP_CKPT_MERGE" in -o out.pt >/dev/null 2>err.txt
echo "exit $?"
sed "s/\.$dead,/.PID,/" err.txt
ls
"$FSDP_CKPT_MERGE" in -o out.safetensors >/dev/null
echo "exit $?"
