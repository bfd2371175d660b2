# The committed torch 1.13 fixture: summary and table.
cp "$FSDP_TESTDATA_DIR/torch_save/tiny_state_dict.pt" .
"$FSDP_CKPT_INSPECT" tiny_state_dict.pt
