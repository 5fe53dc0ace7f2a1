# runcell bash context driver. The agent starts this as the sandbox user with
# fd 3 (cells in: "<length>\n<path of the cell file>\n") and fd 4 (events out).
# Each cell is sourced into this shell, so variables, functions, the working
# directory and `set` options persist from one cell to the next.
exec {__runcell_ctrl}<&3 {__runcell_events}>&4 3<&- 4>&-
# An interrupt (the cell's timeout) returns from the cell being sourced.
trap 'return 130 2>/dev/null' INT
printf '{"type":"ready","preload_errors":[]}\n' >&"$__runcell_events"
while IFS= read -r -u "$__runcell_ctrl" __runcell_cell; do
    __runcell_start=${EPOCHREALTIME/./}
    source "$__runcell_cell"
    __runcell_rc=$?
    __runcell_ms=$(( (${EPOCHREALTIME/./} - __runcell_start) / 1000 ))
    printf '{"type":"done","exit_code":%d,"error":null,"duration_ms":%d}\n' \
        "$__runcell_rc" "$__runcell_ms" >&"$__runcell_events"
done
