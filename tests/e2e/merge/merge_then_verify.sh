# Merge the 2-rank fixture into torch.save and safetensors files; both pass verify --deep.
set -e
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o merged.pt
"$FSDP_CKPT_INSPECT" verify --deep merged.pt
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" -o model.safetensors --exclude '*.count'
"$FSDP_CKPT_INSPECT" verify --deep model.safetensors
ls
