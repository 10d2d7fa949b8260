"""Builds data/train.txt and data/val.txt from the King James Version text.

Source: Debian package `bible-kjv` (text data from `bible-kjv-text`), dumped with
`bible -f "gen1:1-rev22:21" > kjv.txt`. Verse references are stripped; each
chapter becomes one paragraph block. Every 20th chapter goes to validation, so
both splits span the whole book with the same style.
"""
import re
import sys

src = sys.argv[1] if len(sys.argv) > 1 else "kjv.txt"
chapters = []  # (book+chapter key, [verses])
for line in open(src, encoding="ascii"):
    m = re.match(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$", line.rstrip("\n"))
    if not m:
        continue
    key = (m.group(1), m.group(2))
    if not chapters or chapters[-1][0] != key:
        chapters.append((key, []))
    chapters[-1][1].append(m.group(4))

train, val = [], []
for i, (_, verses) in enumerate(chapters):
    (val if i % 20 == 19 else train).append("\n".join(verses) + "\n")
open("train.txt", "w").write("\n".join(train))
open("val.txt", "w").write("\n".join(val))
print(len(chapters), "chapters")
