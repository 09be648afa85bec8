"""Files: the untrusted gate (what a file may make a reader allocate), locks, atomic writes, the one staged
writer, streamed saves. Knows no checkpoint format; imports only ``core``."""
