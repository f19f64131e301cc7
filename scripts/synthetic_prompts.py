"""Distinct chat prompts of Spec-Bench's kinds, made from templates and text found on this machine,
for `selfspec calibrate --head feature --extra-prompts FILE` (training only, never held out).

The feature head learns the model's own answers; its held-out α is limited by how many *distinct*
prompts it has seen (438 Spec-Bench questions: α 0.57 on training prompts, 0.31 held out). These
prompts add more of the same kinds, none taken from Spec-Bench:

- translation: "Translate German to English:" + a German message from the system's gettext
  catalogues (/usr/share/locale/de/LC_MESSAGES/*.mo: program messages, translated by people);
- summarization and rag: passages from the installed Python distributions' READMEs and pydoc's
  topics (scripts/local_text.py), with "Summarize:" or a question about the passage;
- qa: short questions about Python modules and reference topics, and about everyday subjects;
- math_reasoning: word problems from templates, with random names, items and numbers;
- the MT-bench kinds (writing, roleplay, reasoning, coding, extraction, stem, humanities): templates
  over a fixed list of subjects.

    .venv/bin/python scripts/synthetic_prompts.py -o /tmp/synthetic.jsonl [-n 800] [--seed 0]

Seeded and written in a fixed order, so the same machine setup gives the same file.
"""

from __future__ import annotations

import argparse
import gettext
import glob
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_text import documents  # noqa: E402

SUBJECTS = """lighthouse, beehive, glacier, subway system, bakery, violin, desert, coral reef, library, volcano,
chess, bicycle, rainforest, satellite, vaccine, printing press, windmill, marathon, orchestra, submarine,
recycling, solar panel, museum, farmers' market, thunderstorm, telescope, pottery, railway, island, castle,
compost, street food, jazz, origami, earthquake, electric car, honeybee, ocean current, city park, mountain hut,
coffee, tea ceremony, spaceship, robot, dinosaur, wolf pack, migration of birds, public transport, online school,
remote work, social media, friendship, first job, moving to a new city, learning a language, saving money,
healthy breakfast, sleep, exercise, meditation, gardening, camping, photography, podcast, video game, board game,
newspaper, election, recycling plant, hospital, fire station, airport, harbour, bridge, skyscraper, village,
river, forest fire, drought, flood, renewable energy, nuclear power, climate change, the moon, Mars, black hole,
DNA, photosynthesis, the immune system, the heart, the brain, antibiotics, electricity, magnets, gravity, light,
sound, the internet, encryption, databases, compilers, sorting algorithms, spreadsheets, smartphones, batteries,
the Roman Empire, the Renaissance, the Industrial Revolution, ancient Egypt, the Silk Road, democracy, inflation,
taxes, supply and demand, banks, trade, tourism, advertising, a small business, a job interview, a wedding,
a birthday party, a school trip, a rainy day, winter, spring, a lost cat, a haunted house, a detective,
a pirate ship, a dragon, a time machine, a talking tree, a robot chef, a hot-air balloon, an old map""".replace("\n", " ")

KINDS = {
    "writing": [
        "Write a short story about {s}.",
        "Compose a poem about {s}, in four stanzas.",
        "Write a persuasive paragraph about why people should care about {s}.",
        "Draft a friendly email inviting a colleague to an event about {s}.",
        "Write a blog post introduction about {s} for beginners.",
        "Describe {s} using vivid sensory details.",
    ],
    "roleplay": [
        "Pretend you are a tour guide. Introduce visitors to {s}.",
        "Act as a teacher and explain {s} to a class of ten-year-olds.",
        "You are a journalist. Interview an expert about {s}: write three questions and the answers.",
        "Imagine you are a character living next to {s}. Describe your day.",
    ],
    "reasoning": [
        "What are the advantages and disadvantages of {s}?",
        "Compare {s} and {t}. How are they similar, and how are they different?",
        "If {s} disappeared tomorrow, what would change? Think step by step.",
        "Give three reasons why {s} matters and one reason it might not.",
    ],
    "stem": [
        "Explain how {s} works, in simple terms.",
        "What is the science behind {s}?",
        "Describe the history and the main ideas of {s}.",
    ],
    "humanities": [
        "How has {s} changed society over the last hundred years?",
        "Discuss the cultural importance of {s}.",
        "What can people learn from {s}? Give examples.",
    ],
    "extraction": [
        "List the key facts in the following text as bullet points:\n{p}",
        "Extract every name, number and date from this text, in a table:\n{p}",
    ],
    "coding": [
        "Write a Python function that {f}. Include a docstring and an example.",
        "Explain what this Python code does, line by line:\n{c}",
        "Write a Python program that reads a text file and {g}.",
    ],
}
FILE_TASKS = ["counts the words in it", "prints the longest line", "removes blank lines", "sorts its lines",
              "finds every email address", "prints each line reversed", "counts how often each letter occurs",
              "replaces tabs with four spaces", "prints the ten most common words", "numbers every line"]
QA = ["What is {s}?", "Why is {s} important?", "Who invented or discovered {s}?", "Where can you find {s}?",
      "When did {s} first appear?", "How do people use {s} today?"]
RAG = ["Based on the passage, what is the main purpose of what it describes?",
       "According to the passage, how do you get started?", "What problem does the passage say this solves?",
       "Which options or features does the passage mention?", "What does the passage recommend, and why?"]
NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lena", "Omar", "Sofia", "Raj", "Ella", "Mateo", "Nina", "Sam"]
ITEMS = [("apples", "a bag"), ("pencils", "a box"), ("stickers", "a sheet"), ("cookies", "a tray"),
         ("marbles", "a jar"), ("books", "a shelf"), ("eggs", "a carton"), ("flowers", "a bunch")]


def math_problem(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    item, unit = rng.choice(ITEMS)
    x, y, z = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
    price = rng.choice([2, 3, 4, 5, 6, 8, 12, 15])
    pct = rng.choice([10, 20, 25, 30, 40, 50])
    return rng.choice([
        f"{a} has {x} {item}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {item} does {a} have now?",
        f"{item.capitalize()} cost ${price} each. {a} buys {y} of them and pays with a $100 bill. How much change does {a} get?",
        f"{a} packs {item} into {unit}s of {z}. How many {unit}s does {a} need for {x * z + rng.randint(1, z - 1)} {item}?",
        f"{a} earns ${x * 10} a week and saves {pct}% of it. How much does {a} save in {y} weeks?",
        f"A train travels {x * 5} miles in {z} hours. At the same speed, how far does it travel in {y} hours?",
        f"{a} is {y} years older than {b}. In {z} years their ages will add up to {2 * x + y + 2 * z}. How old is {b} now?",
        f"A shop sells {item} at ${price * 10} each and gives {pct}% off on orders of {z} or more. What do {y + z} {item} cost?",
        f"{a} reads {y} pages a day. The book has {x * 10} pages. After {z} days, how many pages are left?",
        f"{a} and {b} share {x * 6} {item} in the ratio 1:2. How many {item} does each get?",
        f"A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    ])


def german_sentences(limit: int = 20000) -> list[str]:
    """German translations of program messages: whole sentences of 6-40 words, no format codes."""
    out = set()
    for path in sorted(glob.glob("/usr/share/locale/de/LC_MESSAGES/*.mo")):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        for text in catalog._catalog.values():
            text = " ".join(str(text).split())
            if ("%" not in text and "{" not in text and "\\" not in text and "<" not in text
                    and 6 <= len(text.split()) <= 40 and text[-1:] in ".!?"):
                out.add(text)
        if len(out) >= limit:
            break
    return sorted(out)


def passages(rng: random.Random, n: int, min_words: int = 80, max_words: int = 320) -> list[str]:
    """Runs of whole paragraphs from local documents, each between min_words and max_words."""
    found = []
    for name, text in documents():
        if name == "dist:selfspec":  # our own README: never train on text about the benchmarks
            continue
        paragraph = []
        for block in re.split(r"\n\s*\n", text):
            block = " ".join(block.split())
            if (not block or block.startswith(("```", "..", "|", "![", "[", "<", "=", "-", "*", "#", ">>>"))
                    or "](http" in block or sum(c.isalpha() or c == " " for c in block) < 0.85 * len(block)):
                continue
            paragraph.append(block)
            words = sum(len(b.split()) for b in paragraph)
            if words >= min_words:
                if words <= max_words:
                    found.append("\n\n".join(paragraph))
                paragraph = []
    rng.shuffle(found)
    return found[:n]


def functions() -> list[tuple[str, str]]:
    """(task, source) of small pure-Python functions of the standard library that have a docstring."""
    import inspect
    import importlib

    out = []
    for name in ("textwrap", "shlex", "fnmatch", "colorsys", "statistics", "heapq", "bisect", "calendar",
                 "string", "difflib", "glob", "posixpath", "base64", "html", "csv", "json.encoder"):
        module = importlib.import_module(name)
        for fname, fn in sorted(vars(module).items()):
            if fname.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            doc = (inspect.getdoc(fn) or "").split("\n")[0].strip().rstrip(".")
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if 8 <= len(doc) <= 120 and source.count("\n") <= 30:
                task = doc[0].lower() + doc[1:]
                out.append((task, source))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--out", required=True, help="the JSONL file to write (rows: category, turns)")
    parser.add_argument("-n", type=int, default=800, help="prompts to write (default 800)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    subjects = [s.strip() for s in SUBJECTS.split(",") if s.strip()]
    german = german_sentences()
    texts = passages(rng, args.n)
    code = functions()
    # shares of Spec-Bench's own mix: its five large categories, then the MT-bench kinds
    shares = {"translation": 0.17, "summarization": 0.14, "rag": 0.12, "qa": 0.15, "math_reasoning": 0.17}
    counts = {k: round(v * args.n) for k, v in shares.items()}
    counts["mt"] = args.n - sum(counts.values())
    prompts: dict[str, list[str]] = {}

    def add(kind: str, text: str) -> None:
        prompts.setdefault(kind, []).append(text)

    for sentence in rng.sample(german, min(counts["translation"], len(german))):
        add("translation", f"Translate German to English: {sentence}")
    pool = iter(texts)
    for _ in range(counts["summarization"]):
        add("summarization", f"Summarize: {next(pool)}")
    for _ in range(counts["rag"]):
        add("rag", f"{next(pool)}\n\n{rng.choice(RAG)}")
    for i in range(counts["qa"]):
        if i % 3 == 0 and code:
            add("qa", f"What does the Python function that {rng.choice(code)[0]} do, and when would I use it?")
        else:
            add("qa", rng.choice(QA).format(s=rng.choice(subjects)))
    for _ in range(counts["math_reasoning"]):
        add("math_reasoning", math_problem(rng))
    kinds = sorted(KINDS)
    for i in range(counts["mt"]):
        kind = kinds[i % len(kinds)]
        s, t = rng.sample(subjects, 2)
        f, c = rng.choice(code)
        p = next(pool, None) or rng.choice(texts)
        add(kind, rng.choice(KINDS[kind]).format(s=s, t=t, f=f, c=c.strip(), p=p, g=rng.choice(FILE_TASKS)))
    rows, seen = [], set()
    # interleaved kind by kind, so that --num-prompts N takes a balanced share
    for i in range(max(len(v) for v in prompts.values())):
        for kind in sorted(prompts):
            if i < len(prompts[kind]) and prompts[kind][i] not in seen:
                seen.add(prompts[kind][i])
                rows.append({"category": kind, "turns": [prompts[kind][i]], "source": "synthetic"})
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    by_kind = ", ".join(f"{k} {len(v)}" for k, v in sorted(prompts.items()))
    print(f"{args.out}: {len(rows)} distinct prompts ({by_kind}); {len(german)} German sentences, "
          f"{len(texts)} passages, {len(code)} functions available")


if __name__ == "__main__":
    main()
