# --verify checks every CRC-32 the input's archives record, from the bytes the copy reads (issue 28
# item 11): a byte flipped in a tensor's data is copied without it (what a plain merge and shard
# did), and with it merge and shard fail naming the file and the record's offset, writing nothing.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank" ck
"$FSDP_CKPT_MERGE" -q ck -o clean.pt --verify && "$FSDP_CKPT_SHARD" -q ck -o clean -n 3 --verify && echo "clean: exit 0"
"$FSDP_CKPT_INSPECT" --json ck | /usr/bin/python3 -c '
import io, json, sys, zipfile
j = json.load(sys.stdin)
c = [e for e in j["entries"] if e["name"] == "model.embed.weight"][0]["chunks"][0]
path = "ck/" + c["file"]
blob = bytearray(open(path, "rb").read())
item = bytes(blob[c["offset"]:c["offset"] + c["length"]])
z = zipfile.ZipFile(io.BytesIO(item))
m = [i for i in z.infolist() if "/data/" in i.filename][0]
name_len, extra_len = int.from_bytes(item[m.header_offset + 26:m.header_offset + 28], "little"), \
    int.from_bytes(item[m.header_offset + 28:m.header_offset + 30], "little")  # the local header, padded
at = c["offset"] + m.header_offset + 30 + name_len + extra_len + 5
blob[at] ^= 0x40
open(path, "wb").write(blob)'
"$FSDP_CKPT_MERGE" -q ck -o plain.pt && echo "plain merge: exit 0, the damage copied"
"$FSDP_CKPT_MERGE" -q ck -o checked.pt --verify
echo "exit $?"
"$FSDP_CKPT_MERGE" -q ck -o checked.safetensors --verify --dtype bf16
echo "exit $?"
"$FSDP_CKPT_SHARD" -q ck -o checked -n 3 --verify
echo "exit $?"
ls
# a torch.save file as input: its records' CRCs are checked the same way
/usr/bin/python3 -c '
import zipfile
z = zipfile.ZipFile("clean.pt")
i = [i for i in z.infolist() if "/data/" in i.filename][0]
b = bytearray(open("clean.pt", "rb").read())
name_len, extra_len = int.from_bytes(b[i.header_offset + 26:i.header_offset + 28], "little"), int.from_bytes(b[i.header_offset + 28:i.header_offset + 30], "little")
b[i.header_offset + 30 + name_len + extra_len + 1] ^= 1
open("clean.pt", "wb").write(b)'
"$FSDP_CKPT_MERGE" -q clean.pt -o from_pt.safetensors --verify
echo "exit $?"
"$FSDP_CKPT_SHARD" -q clean.pt -o from_pt -n 2 --verify
echo "exit $?"
ls from_pt* 2>/dev/null
