# A torch.save file cut short: exit 1, the file and the offset named.
head -c 1000 "$FSDP_TESTDATA_DIR/torch_save/tiny_state_dict.pt" > cut.pt
"$FSDP_CKPT_INSPECT" cut.pt
