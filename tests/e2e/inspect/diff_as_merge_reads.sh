# diff reads a checkpoint as merge reads it (issue 28 item 8): `merge X -o Y && diff X Y` is equal
# for every output format (safetensors: the tensors under 'model' by their names below it; HDF5
# and safetensors hold no non-tensors), with merge's selections, across a --dtype cast within
# --rtol (the dtype change noted), and for a Lightning folder whose meta.pt merge merges in.
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_4rank" ck
for out in m.pt m.safetensors m.h5; do
  "$FSDP_CKPT_MERGE" -q ck -o $out >/dev/null && "$FSDP_CKPT_INSPECT" diff ck $out
done
"$FSDP_CKPT_MERGE" -q ck -o hf --max-shard-size 200B >/dev/null && "$FSDP_CKPT_INSPECT" diff ck hf/model.safetensors.index.json
"$FSDP_CKPT_MERGE" -q ck -o sel.pt --model-only --exclude '*.bias' >/dev/null && "$FSDP_CKPT_INSPECT" diff ck sel.pt --model-only --exclude '*.bias'
"$FSDP_CKPT_MERGE" -q ck -o bf.pt --dtype bf16 >/dev/null
"$FSDP_CKPT_INSPECT" diff ck bf.pt
echo "exit $?"
"$FSDP_CKPT_INSPECT" diff ck bf.pt --rtol 1e-2
"$FSDP_CKPT_INSPECT" diff ck m.safetensors --key optim
echo "exit $?"
"$FSDP_CKPT_INSPECT" diff ck m.pt --map-prefix 'model.=net.' | tail -1
cp -r ck lightning
/usr/bin/python3 -c 'import torch; torch.save({"epoch": 9, "hparams": {"name": "tiny"}, "rng": torch.arange(5)}, "lightning/meta.pt")' || exit 77
"$FSDP_CKPT_MERGE" -q lightning -o l.pt >/dev/null && "$FSDP_CKPT_INSPECT" diff lightning l.pt
