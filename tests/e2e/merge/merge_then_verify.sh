# Merge the 2-rank fixture into torch.save, safetensors and HDF5 files; each passes verify --deep
# and fsdp-ckpt-inspect reads the HDF5 file back.
set -e
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o merged.pt
"$FSDP_CKPT_INSPECT" verify --deep merged.pt
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o model.safetensors --exclude '*.count'
"$FSDP_CKPT_INSPECT" verify --deep model.safetensors
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o merged.h5
"$FSDP_CKPT_INSPECT" verify --deep merged.h5
"$FSDP_CKPT_INSPECT" merged.h5 | tail -7
ls
