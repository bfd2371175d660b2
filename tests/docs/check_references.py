#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The format notes the code cites are in the repository: every `docs/formats/<file>.md#<section>`
in the sources names a file of docs/formats/ and one of its headings, every section of those files
says which tests check it ("Checked by:"), and every path it names there exists. No source cites
a specification outside the repository."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[2])
docs = root / "docs" / "formats"
CITE = re.compile(r"docs/formats/([a-z0-9_]+\.md)(?:#([a-z0-9_-]+))?")
OUTSIDE = re.compile(r"spec/FORMATS\.md|FORMATS\.md §|§\d")


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    s = heading.strip().lower()
    s = re.sub(r"[^a-z0-9 _-]", "", s)
    return s.replace(" ", "-")


sections = {}
failures = []
for md in sorted(docs.glob("*.md")):
    text = md.read_text()
    anchors = set()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        anchors.add(slug(heading))
        if md.name != "README.md":
            m = re.search(r"Checked by: (.+?)(?:\n\n|\Z)", body, flags=re.S)
            if not m:
                failures.append(f"{md.relative_to(root)}: section '{heading}' says no 'Checked by:'")
                continue
            for path in re.findall(r"`((?:tests|testdata)/[^`]+?)`", m.group(1)):
                if not (root / path).exists():
                    failures.append(f"{md.relative_to(root)}: section '{heading}' names {path}, which does not exist")
    sections[md.name] = anchors

cited = 0
for src in sorted(p for d in ("libckpt", "libfsdp", "tools", "tests", "bench") for p in (root / d).rglob("*")
                  if p.suffix in (".cpp", ".hpp", ".py", ".sh") and p.is_file()):
    if src.name == "check_references.py":
        continue
    for n, line in enumerate(src.read_text(errors="replace").splitlines(), 1):
        where = f"{src.relative_to(root)}:{n}"
        if OUTSIDE.search(line):
            failures.append(f"{where}: cites a specification outside the repository: {line.strip()}")
        for file, anchor in CITE.findall(line):
            cited += 1
            if file not in sections:
                failures.append(f"{where}: docs/formats/{file} does not exist")
            elif anchor and anchor not in sections[file]:
                failures.append(f"{where}: docs/formats/{file} has no section #{anchor}")

if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"docs.references: {cited} citations of {len(sections)} format notes resolve")
