# A legacy torch.save file (torch < 1.6) is a checkpoint like any: inspected, verified, and equal
# to the zip-format file of the same object.
cp "$FSDP_TESTDATA_DIR/torch_save/legacy_tiny_state_dict.pt" "$FSDP_TESTDATA_DIR/torch_save/tiny_state_dict.pt" .
"$FSDP_CKPT_INSPECT" legacy_tiny_state_dict.pt
"$FSDP_CKPT_INSPECT" verify --deep legacy_tiny_state_dict.pt
"$FSDP_CKPT_INSPECT" diff legacy_tiny_state_dict.pt tiny_state_dict.pt
