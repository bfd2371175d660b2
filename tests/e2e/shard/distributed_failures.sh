# Several processes: one that is stopped (SIGTERM) mid-copy writes a failure marker, and process 0
# names it and writes no .metadata; one that is killed (SIGKILL) leaves no marker, and process 0
# names it when --timeout passes. Either way nothing that looks like a checkpoint is left, and a
# rerun of both processes completes the checkpoint. (The stopped process copies with one thread,
# so that the file its message names does not depend on which thread noticed the stop first.)
in="$FSDP_TESTDATA_DIR/dcp/torch113_4rank"
# Waits until process 1 is copying (its first temporary data file exists).
copying() { for _ in $(seq 400); do ls out.partial 2>/dev/null | grep -q '\.tmp\.' && return; sleep 0.05; done; echo "process 1 never started"; }
RANK=1 WORLD_SIZE=2 FSDP_TEST_COPY_DELAY_MS=300 "$FSDP_CKPT_SHARD" -q -j 1 "$in" -o out -n 4 >/dev/null 2>p1.err &
p1=$!
copying
kill -TERM $p1
wait $p1
echo "process 1: exit $?"
RANK=0 WORLD_SIZE=2 "$FSDP_CKPT_SHARD" -q "$in" -o out -n 4 --timeout 30 2>&1 >/dev/null | sed -E 's/\.tmp\.[0-9]+/.tmp.PID/g'
echo "process 0: exit ${PIPESTATUS[0]}"
ls -A out.partial | grep -c metadata
{  # the shell's own "Killed" job report goes to this block's stderr
  RANK=1 WORLD_SIZE=2 FSDP_TEST_COPY_DELAY_MS=300 "$FSDP_CKPT_SHARD" -q "$in" -o out -n 4 >/dev/null 2>&1 &
  p1=$!
  copying
  kill -KILL $p1
  wait $p1
} 2>/dev/null
echo "process 1: killed"
RANK=0 WORLD_SIZE=2 "$FSDP_CKPT_SHARD" -q "$in" -o out -n 4 --timeout 1 2>&1 >/dev/null
echo "process 0: exit ${PIPESTATUS[0]}"
ls -A out.partial | grep -c metadata
ls
RANK=1 WORLD_SIZE=2 "$FSDP_CKPT_SHARD" -q "$in" -o out -n 4 >/dev/null &
RANK=0 WORLD_SIZE=2 "$FSDP_CKPT_SHARD" -q "$in" -o out -n 4 >/dev/null
echo "process 0: exit $?"
wait
"$FSDP_CKPT_INSPECT" verify --deep out
ls -A . out
