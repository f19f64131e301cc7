"""Put a `selfspec bench --markdown` report into README.md between its bench markers, verbatim:
its setup, memory note and overall table (the per-category tables stay in the report file).

    python scripts/readme_bench.py results/bench_smollm2/bench.md
"""

import re
import sys
from pathlib import Path

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def main(report: str, readme: str = "README.md") -> None:
    text = Path(readme).read_text()
    if START not in text or END not in text:
        sys.exit(f"{readme} has no {START} ... {END} markers")
    body = Path(report).read_text().split("\nCategory ")[0].strip()
    new = re.sub(re.escape(START) + ".*?" + re.escape(END),
                 lambda _: f"{START}\n<!-- generated from {report} by scripts/readme_bench.py -->\n\n{body}\n\n{END}",
                 text, flags=re.S)
    Path(readme).write_text(new)


if __name__ == "__main__":
    main(*sys.argv[1:])
