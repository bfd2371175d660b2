# A safetensors file written by the reference implementation (../shared/testdata-real).
src="$FSDP_SHARED_TESTDATA_DIR/huggingface__safetensors__samples/overall.safetensors"
[[ -f $src ]] || { echo "$src is absent"; exit 77; }
cp "$src" .
"$FSDP_CKPT_INSPECT" overall.safetensors
