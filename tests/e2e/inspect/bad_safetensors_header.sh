# A safetensors header whose length points past the end of the file.
printf '\xff\x00\x00\x00\x00\x00\x00\x00{}' > bad.safetensors
"$FSDP_CKPT_INSPECT" bad.safetensors
