# The same fixture as JSON schema 1 (every chunk's absolute offset and length).
cp "$FSDP_TESTDATA_DIR/torch_save/tiny_state_dict.pt" .
"$FSDP_CKPT_INSPECT" --json tiny_state_dict.pt
