#!/usr/bin/env bash
# A larger real-text corpus for bench/fp8_convergence.py: this machine's English man pages as plain text,
# one paragraph a line, cut at ~16 MB (~4M tokens at 8k vocab, more than 300 steps x 8 x 1,024 read).
#     bash bench/man_corpus.sh .corpus/man_en.txt.gz
# Needs groff and man pages installed; takes ~10 min on 8 cores for all of them.
set -eu  # no pipefail: head closing the pipe early is the point
out=${1:?usage: man_corpus.sh OUT.txt.gz}
render() {
    zcat "$1" 2>/dev/null | groff -k -Tutf8 -mandoc -rLL=3000n -rHY=0 -P-c -P-b -P-u 2>/dev/null | python3 -c '
import re, sys
para = []
for line in sys.stdin:
    line = re.sub(r"\s+", " ", line).strip()
    if line:
        para.append(line)
    elif para:
        print(" ".join(para))
        para = []
if para:
    print(" ".join(para))
' || true
}
export -f render
mkdir -p "$(dirname "$out")"
ls /usr/share/man/man[1-8]/*.gz | sort | xargs -P 8 -I{} bash -c 'render {}' | head -c 16000000 | head -n -1 | gzip -6 >"$out"
