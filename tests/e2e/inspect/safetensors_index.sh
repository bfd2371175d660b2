# A Hugging Face sharded safetensors folder (written by fsdp-ckpt-merge from the 4-rank fixture's
# tensors under 'model'):
# inspect reads the index and its shards; verify --deep reads every byte; a weight_map entry that
# names the wrong shard, and a shard name that leaves the directory, are refused with the index named.
"$FSDP_CKPT_MERGE" -q "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" -o hf --max-shard-size 200B >/dev/null || exit 1
"$FSDP_CKPT_INSPECT" --json hf/model.safetensors.index.json | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)
print(j["format"], len(j["files"]), "files", len(j["entries"]), "entries")
for e in j["entries"]:
    print(e["name"], e["dtype"], e["shape"], e["chunks"][0]["file"])'
"$FSDP_CKPT_INSPECT" verify --deep hf/model.safetensors.index.json
sed 's/"head.bias": "model-00002/"head.bias": "model-00001/' hf/model.safetensors.index.json > hf/wrong.index.json
"$FSDP_CKPT_INSPECT" hf/wrong.index.json
echo "exit $?"
sed 's/"head.bias": "model-00002-of-00002.safetensors"/"head.bias": "..\/x.safetensors"/' hf/model.safetensors.index.json > hf/escape.index.json
"$FSDP_CKPT_INSPECT" hf/escape.index.json
echo "exit $?"
