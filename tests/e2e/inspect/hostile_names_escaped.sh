# A tensor name with an escape sequence and a newline is printed escaped, never raw.
python3 - <<'PY'
import json, struct
h = json.dumps({"evil\u001b[2J\nname": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
open("evil.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"\x00")
PY
"$FSDP_CKPT_INSPECT" evil.safetensors | tail -n 1
