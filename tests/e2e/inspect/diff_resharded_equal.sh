# The same state saved from 2 and from 4 ranks compares equal; a file with one changed value
# does not (exit 1, the tensor and its max difference named).
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" a
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" b
"$FSDP_CKPT_INSPECT" diff a b || exit 1
cp "$FSDP_TESTDATA_DIR/torch_save/tiny_state_dict.pt" x.pt
cp x.pt y.pt
# model.w is float32 arange(6) in data/0 at byte 704 (its zip member's data offset, `unzip -lv`); make w[1] = 3.0
printf '\x00\x00\x40\x40' | dd of=y.pt bs=1 seek=708 conv=notrunc status=none
"$FSDP_CKPT_INSPECT" diff --atol 0.5 x.pt y.pt
