#!/usr/bin/env bash
# Runs on the GPU machine. SmolLM2's GGUF (94 MiB) is over what one device call carries (64 MiB), so it
# travels in three parts, one per call of the final run (carry .gguf_a, .gguf_b, .gguf_c; split with
# `head -c`/`tail -c`, see docs/notes-engine.md). Each call stashes its part in /tmp (kept while the machine
# stays warm between calls); when all three are there, this joins them into /tmp/smollm2/ and checks the sum.
set -u
want=b179c9523d0e6a0f   # first 16 hex digits of the file's sha256
mkdir -p /tmp/smollm2-parts /tmp/smollm2
for p in .gguf_a/part_a .gguf_b/part_b .gguf_c/part_c; do
  [ -f "$p" ] && cp "$p" /tmp/smollm2-parts/
done
ls /tmp/smollm2-parts
f=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$f" ] && [ -f /tmp/smollm2-parts/part_a ] && [ -f /tmp/smollm2-parts/part_b ] && [ -f /tmp/smollm2-parts/part_c ]; then
  cat /tmp/smollm2-parts/part_a /tmp/smollm2-parts/part_b /tmp/smollm2-parts/part_c > "$f"
  got=$(sha256sum "$f" | cut -c1-16)
  if [ "$got" != "$want" ]; then echo "gguf: checksum $got != $want, discarded"; rm -f "$f"; fi
fi
[ -f "$f" ] && echo "gguf: $f ready" || echo "gguf: not complete on this machine"
