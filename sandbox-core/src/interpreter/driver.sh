# The bash driver of an interpreter context on the process tiers (container, gVisor,
# microVM): one long-lived `bash` whose cells run in the driver's own shell (`eval`), so
# variables, functions, options and the working directory carry over. The host writes the
# mark and the working directory as two lines, then one request per cell: a line
# `N PRE CODE POST` (byte lengths) and those bytes (the cell's environment set up, the cell,
# its environment put back). `read -N` in the C locale counts bytes and reads them in
# chunks (bash 5.1 on). The requests come on a descriptor of the driver's own, closed for
# the cells (whose stdin is /dev/null), and the frames go on copies of stdout and stderr
# taken at the start, so a cell that redirects or closes its streams still ends: after
# each cell, an `error` frame when its status is not 0, then a `done` frame carrying the
# status on both streams, each line `MARK + JSON + "\n"`. A cell's `break` or `continue`
# reaches the loop below: the cell is finished in the loop's condition, and the outer
# loop takes a `break` back in.
exec {__asb_in}<&0 {__asb_o}>&1 {__asb_e}>&2 </dev/null
IFS= builtin read -r __asb_mark <&"$__asb_in" || exit 0
IFS= builtin read -r __asb_cwd <&"$__asb_in" || exit 0
if [ -n "$__asb_cwd" ]; then
  cd -- "$__asb_cwd" || exit 1
fi
unset __asb_cwd
__asb_read() {
  # $1 bytes of the request into variable $2 (none: empty).
  if [ "$1" -gt 0 ]; then
    LC_ALL=C IFS= builtin read -r -N "$1" -u "$__asb_in" "$2"
  else
    builtin printf -v "$2" ''
  fi
}
__asb_end() {
  # Finishes the cell in progress, if one is: its environment put back, its frames.
  [ -n "$__asb_busy" ] || return 0
  __asb_busy=
  eval "$__asb_post"
  if [ "$__asb_status" -ne 0 ]; then
    builtin printf '%s{"t":"error","name":"ExitStatus","value":"%d","traceback":[]}\n' \
      "$__asb_mark" "$__asb_status" >&"$__asb_o"
  fi
  builtin printf '%s{"t":"done","n":%d,"exit":%d}\n' "$__asb_mark" "$__asb_n" \
    "$__asb_status" >&"$__asb_e"
  builtin printf '%s{"t":"done","n":%d,"exit":%d}\n' "$__asb_mark" "$__asb_n" \
    "$__asb_status" >&"$__asb_o"
}
builtin printf '%s{"t":"ready","version":"%s"}\n' "$__asb_mark" \
  "${BASH_VERSION%%[!0-9.]*}" >&"$__asb_o"
__asb_busy=
while :; do
  while __asb_end; IFS=' ' builtin read -r __asb_n __asb_a __asb_b __asb_c <&"$__asb_in"; do
    case "$__asb_n$__asb_a$__asb_b$__asb_c" in
      *[!0-9]* | '') continue ;;
    esac
    __asb_read "$__asb_a" __asb_pre || exit 0
    __asb_read "$__asb_b" __asb_code || exit 0
    __asb_read "$__asb_c" __asb_post || exit 0
    eval "$__asb_pre"
    __asb_busy=1
    __asb_status=0
    eval "$__asb_code" {__asb_in}<&-
    __asb_status=$?
  done
  # The requests ended (the host is gone), or a cell's `break` left the loop.
  [ -n "$__asb_busy" ] || exit 0
done
