# Every --long-option in --help appears in the man page, and the page is clean for groff.
for tool in fsdp-ckpt-inspect; do
  var=FSDP_$(echo "${tool#fsdp-}" | tr 'a-z-' 'A-Z_')
  page="$FSDP_MAN_DIR/$tool.1"
  [[ -f $page ]] || { echo "no man page $page"; exit 1; }
  for opt in $("${!var}" --help | grep -o -E -- '--[a-z][a-z0-9-]+' | sort -u); do
    grep -q -- "$(printf '%s' "$opt" | sed 's/-/\\\\-/g')" "$page" || grep -q -- "$opt" "$page" || { echo "$tool: $opt is not in $page"; exit 1; }
  done
  warnings=$(groff -man -ww -z "$page" 2>&1)
  [[ -z $warnings ]] || { echo "$page: $warnings"; exit 1; }
done
