# libhdf5 reads an HDF5 file's structure in a child process (NOTE [libhdf5 in a child]): when it
# dies there (here made to, by the test hook), the tool reports a clean error and writes nothing.
seed="$FSDP_TESTDATA_DIR/../tests/fuzz/corpus/hdf5/merged_torch113_2rank.h5"
cp "$seed" model.h5
if ! "$FSDP_CKPT_MERGE" -q model.h5 -o ok.pt >/dev/null 2>err.txt; then
  grep -q "HDF5 is not available" err.txt && { echo "this build has no HDF5"; exit 77; }
fi
FSDP_TEST_CRASH_AT=hdf5-child "$FSDP_CKPT_MERGE" -q model.h5 -o out.pt
status=$?
ls out.pt* 2>/dev/null
exit $status
