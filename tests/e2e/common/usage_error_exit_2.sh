"$FSDP_CKPT_INSPECT" --no-such-option x
