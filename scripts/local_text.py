"""Plain English text found on this machine, for `selfspec calibrate --head feature --text FILE`:
the long descriptions of the installed Python distributions (their READMEs, from package
metadata) and the reference topics Python ships for `help()` (pydoc_data). Nothing is downloaded;
the text is the same on any machine set up by scripts/setup.sh (the same packages, the same Python).

    .venv/bin/python scripts/local_text.py -o /tmp/local_text.txt [--max-chars 1500000]

Documents are separated by blank lines and written in a fixed order (sorted by name), so the
file, and the data made from it, are reproducible.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re


def documents(min_chars: int = 500) -> list[tuple[str, str]]:
    """(name, text) of every installed distribution's long description and every pydoc topic."""
    docs = {}
    for dist in importlib.metadata.distributions():
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        body = body or dist.metadata.get("Description") or ""
        name = dist.metadata.get("Name") or "?"
        if isinstance(body, str) and len(body) >= min_chars:
            docs[f"dist:{name.lower()}"] = body
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for key, text in topics.items():
        if len(text) >= min_chars:
            docs[f"topic:{key}"] = text
    return sorted(docs.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--out", required=True, help="the text file to write")
    parser.add_argument("--max-chars", type=int, default=1_500_000, help="stop after this many characters")
    args = parser.parse_args()
    total, kept = 0, 0
    with open(args.out, "w", encoding="utf-8") as f:
        for _, text in documents():
            text = re.sub(r"\n{3,}", "\n\n", text.strip())
            if total + len(text) > args.max_chars:
                continue
            f.write(text + "\n\n")
            total, kept = total + len(text) + 2, kept + 1
    print(f"{args.out}: {kept} documents, {total:,} characters")


if __name__ == "__main__":
    main()
