"""Build data/lid/{en,tr,ru}.txt: real English, Turkish and Russian sentences for the language-ID and
cleaning tests, from the gettext catalogues Debian packages install under /usr/share/locale (offline).

    python data/lid/build.py            # run on a Debian 12 machine; writes the three files here

Turkish and Russian are the catalogues' translations (msgstr); English is their source strings (msgid).
Cleaned like data/az/build.py: one sentence a line, markup and placeholders out, at least 5 words.
"""

import glob
import hashlib
import os
import random
import re
import struct
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = ("iso_", "xkeyboard-config")  # country/language/keyboard names: lists, not sentences
BUDGET = {"en": 50_000, "tr": 50_000, "ru": 80_000}  # bytes (Cyrillic takes two a letter)


def read_mo(path: str) -> list[tuple[str, str]]:
    data = open(path, "rb").read()
    e = "<" if struct.unpack("<I", data[:4])[0] == 0x950412DE else ">"
    _, n, oo, to = struct.unpack(e + "4I", data[4:20])
    pairs = []
    for i in range(n):
        ol, oofs = struct.unpack(e + "2I", data[oo + 8 * i : oo + 8 * i + 8])
        tl, tofs = struct.unpack(e + "2I", data[to + 8 * i : to + 8 * i + 8])
        if ol:
            mid = data[oofs : oofs + ol].split(b"\0")[0].decode("utf-8", "replace")
            pairs.append((mid, data[tofs : tofs + tl].split(b"\0")[0].decode("utf-8", "replace")))
    return pairs


def sentences(text: str) -> list[str]:
    out = []
    for line in text.split("\n"):
        line = " ".join(re.sub(r"<[^>]+>|&", "", line).split())
        if len(line.split()) >= 5 and not re.search(r"[{}$%\\<>_|=\[\]]|--|^-|\.\.\.$|\t", line):
            out.append(line)
    return out


def main() -> None:
    random.seed(0)
    found: dict[str, set[str]] = {"en": set(), "tr": set(), "ru": set()}
    packages: set[str] = set()
    for lang in ("tr", "ru"):
        for path in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
            if os.path.basename(path).startswith(SKIP):
                continue
            owner = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True).stdout.split(":")[0]
            packages.add(owner or os.path.basename(path))
            for mid, msg in read_mo(path):
                found["en"].update(sentences(mid))
                found[lang].update(sentences(msg))
    for lang, lines in found.items():
        pool, picked, size = sorted(lines), [], 0
        random.shuffle(pool)
        for line in pool:
            if size + len(line.encode()) + 1 > BUDGET[lang]:
                break
            picked.append(line)
            size += len(line.encode()) + 1
        text = "\n".join(sorted(picked)) + "\n"
        with open(os.path.join(HERE, f"{lang}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(lang, len(picked), "lines", len(text.encode()), "bytes", digest, "of", len(lines), "candidates")
    print("packages:", " ".join(sorted(packages)))


if __name__ == "__main__":
    main()
