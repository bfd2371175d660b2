# Paths that are not a checkpoint say what they are: a piece of a DCP checkpoint (pass the
# directory), a folder of checkpoints (named, with the newest), a torch.save of torch < 0.4 (a tar),
# a pickle that is not a torch.save file, a legacy torch.save cut after its magic number, data
# files without .metadata (a save that did not commit), and a folder that holds none.
mkdir -p run/step-00000001 run/step-00000002 empty uncommitted
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank/." run/step-00000001/
cp -r "$FSDP_TESTDATA_DIR/dcp/torch113_2rank/." run/step-00000002/
touch -d '2026-01-03 00:00:00' run/step-00000001  # written last: the newest, whatever its name
touch -d '2026-01-02 00:00:00' run/step-00000002
cp "$FSDP_TESTDATA_DIR/dcp/torch113_2rank/__0_0.distcp" uncommitted/
printf '\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.' > cut_legacy.pt
printf '\x80\x02}q\x00.' > dict.pkl
printf 'storages' > storages
tar --format=ustar --mtime=2026-01-01 --owner=0 --group=0 -cf torch03.pt storages
for p in run/step-00000002/__0_0.distcp run/step-00000002/.metadata run torch03.pt dict.pkl cut_legacy.pt uncommitted empty; do
  "$FSDP_CKPT_INSPECT" "$p"
  echo "exit $?"
done
