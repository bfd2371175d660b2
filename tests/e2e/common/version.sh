"$FSDP_CKPT_INSPECT" --version | grep -E -q '^fsdp-ckpt-inspect [0-9]+\.[0-9]+\.[0-9]+ \(.+\)$' || { echo "bad --version"; exit 1; }
