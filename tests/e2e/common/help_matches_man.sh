# Every --long-option in --help (and in each subcommand's --help) appears in the man page, and
# the page is clean for groff.
for tool in fsdp-ckpt-inspect fsdp-ckpt-merge fsdp-ckpt-shard; do
  var=FSDP_$(echo "${tool#fsdp-}" | tr 'a-z-' 'A-Z_')
  page="$FSDP_MAN_DIR/$tool.1"
  [[ -f $page ]] || { echo "no man page $page"; exit 1; }
  helps=$("${!var}" --help)
  for sub in $("${!var}" --help | awk '/^Subcommands:/ {on=1; next} on && !NF {on=0} on && /^  [a-z]/ {print $1}'); do
    grep -q -- "$sub" "$page" || { echo "$tool: subcommand $sub is not in $page"; exit 1; }
    helps+=$'\n'$("${!var}" "$sub" --help)
  done
  for opt in $(grep -o -E -- '--[a-z][a-z0-9-]+' <<<"$helps" | sort -u); do
    grep -q -- "$(printf '%s' "$opt" | sed 's/-/\\\\-/g')" "$page" || grep -q -- "$opt" "$page" || { echo "$tool: $opt is not in $page"; exit 1; }
  done
  warnings=$(groff -man -ww -z "$page" 2>&1)
  [[ -z $warnings ]] || { echo "$page: $warnings"; exit 1; }
done
