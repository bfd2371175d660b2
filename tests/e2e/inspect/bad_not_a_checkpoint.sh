echo "hello" > notes.txt
"$FSDP_CKPT_INSPECT" notes.txt
