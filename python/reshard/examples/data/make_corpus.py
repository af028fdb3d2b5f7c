"""Writes corpus.txt: the small English text corpus shipped with reshard for the trainer
(``python -m reshard.train``) and the recipes.

The text is generated here, deterministically, from word lists and sentence templates
written for this project (no third-party text), so it is free of any copyright: it is
dedicated to the public domain (CC0). It reads as plain, simple English: short tales of
villagers, weather, trades and travel, small arithmetic facts and counting rhymes. That is
enough structure for a causal language model to learn quickly, which is all the trainer's
smoke tests need.

    python python/reshard/examples/data/make_corpus.py            # rewrites corpus.txt in place
    python python/reshard/examples/data/make_corpus.py --check    # exit 1 if corpus.txt differs

Only ``random.Random(seed)`` methods whose output is stable across Python 3 versions are
used (``randrange``/``choice``/``shuffle`` on integers and lists).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_BYTES = 200_000

NAMES = ["Anna", "Tomas", "Greta", "Pieter", "Mira", "Oskar", "Lena", "Jonas", "Elsa", "Hugo",
         "Ida", "Karl", "Nora", "Felix", "Rosa", "Emil", "Clara", "Otto", "Vera", "Anton"]
TRADES = ["miller", "baker", "weaver", "smith", "fisher", "shepherd", "potter", "carpenter",
          "gardener", "teacher", "sailor", "tailor", "cooper", "mason", "farmer", "ferryman"]
PLACES = ["the green valley", "the old harbour", "the hill village", "the river town",
          "the market square", "the stone bridge", "the edge of the forest", "the quiet lake",
          "the windy coast", "the high pasture", "the narrow lane", "the east gate"]
THINGS = ["a basket of apples", "a loaf of bread", "a bundle of wool", "a copper kettle",
          "a wooden chair", "a net full of fish", "a clay jug", "a sack of flour",
          "a lantern", "a blue scarf", "a pair of boots", "a box of nails", "a small boat",
          "a bag of seeds", "a warm blanket", "a letter", "a silver bell", "a map"]
MENDABLE = ["a fishing net", "a torn sail", "a fence", "an old coat", "a basket", "a cart wheel",
            "a leaking bucket", "a pair of boots"]
ANIMALS = ["goats", "sheep", "hens", "geese", "cows", "ducks", "horses", "bees", "cats", "dogs"]
WEATHER = ["the rain fell softly", "the wind blew from the sea", "the sun was warm",
           "a thick fog lay on the fields", "snow covered the roofs", "the sky was clear",
           "clouds gathered over the hills", "the air was cold and still"]
TIMES = ["In the morning", "At noon", "In the evening", "Late at night", "At dawn",
         "On market day", "In the spring", "In the autumn", "During the winter",
         "One summer day", "The next day", "Before supper"]
FEELINGS = ["glad", "tired", "curious", "worried", "proud", "hungry", "calm", "surprised"]
VERBS_TO = ["walked to", "went down to", "rode to", "sailed to", "climbed up to", "came back from"]
GIFTS = ["gave", "sold", "lent", "showed", "brought", "promised"]
SAYINGS = [
    "A kind word costs nothing and is worth a great deal.",
    "The river does not hurry, yet it reaches the sea.",
    "Mend the roof while the sun is shining.",
    "Many hands make the work light.",
    "A full barn in autumn begins with seeds in spring.",
    "Count the sheep before you close the gate.",
    "Slow and steady carries the heavy load.",
    "Bread shared is bread that lasts.",
]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                "seventeen", "eighteen", "nineteen", "twenty"]
COLOURS = ["red", "green", "blue", "yellow", "white", "brown", "grey", "black"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]

PREFACE = """\
The Village Book

This little book was written for the reshard project as plain text for training small
language models. It is dedicated to the public domain. Its tales are short and simple:
people work, trade, travel and talk; the seasons turn; numbers are counted and added.
"""


def sentence(rng: random.Random, who: str, trade: str) -> str:
    k = rng.randrange(12)
    if k == 0:
        return f"{rng.choice(TIMES)}, {who} {rng.choice(VERBS_TO)} {rng.choice(PLACES)}."
    if k == 1:
        return f"{rng.choice(TIMES)}, {rng.choice(WEATHER)}, and {who} felt {rng.choice(FEELINGS)}."
    if k == 2:
        other = rng.choice([n for n in NAMES if n != who])
        return f"{who} {rng.choice(GIFTS)} {other} {rng.choice(THINGS)}."
    if k == 3:
        n = rng.randrange(2, 13)
        return f"The {trade} kept {NUMBER_WORDS[n]} {rng.choice(ANIMALS)} near {rng.choice(PLACES)}."
    if k == 4:
        return f"\"{rng.choice(SAYINGS)[:-1]},\" said {who}."
    if k == 5:
        return f"On {rng.choice(DAYS)} {who} carried {rng.choice(THINGS)} to {rng.choice(PLACES)}."
    if k == 6:
        return f"The door of the {trade}'s house was painted {rng.choice(COLOURS)}."
    if k == 7:
        a, b = rng.randrange(0, 11), rng.randrange(0, 11)
        return (f"{who} counted {NUMBER_WORDS[a]} and then {NUMBER_WORDS[b]} more, "
                f"and that made {NUMBER_WORDS[a + b]}.")
    if k == 8:
        return f"In {rng.choice(MONTHS)} the {trade} worked from dawn until dark."
    if k == 9:
        other = rng.choice([n for n in NAMES if n != who])
        return f"\"Good day, {other},\" said {who}. \"Have you seen {rng.choice(THINGS)}?\""
    if k == 10:
        return f"When {rng.choice(WEATHER)}, {who} stayed at home and mended {rng.choice(MENDABLE)}."
    return f"Everyone at {rng.choice(PLACES)} knew {who} the {trade}."


def tale(rng: random.Random, number: int) -> str:
    who, trade = rng.choice(NAMES), rng.choice(TRADES)
    place = rng.choice(PLACES)
    lines = [f"Tale {number}: {who} the {trade}", "",
             f"Once there was a {trade} called {who} who lived near {place}."]
    paragraphs = []
    for _ in range(rng.randrange(2, 5)):
        body = " ".join(sentence(rng, who, trade) for _ in range(rng.randrange(3, 7)))
        paragraphs.append(body)
    paragraphs[0] = lines[-1] + " " + paragraphs[0]
    wrapped = [textwrap.fill(p, width=88) for p in paragraphs]
    ending = f"And so {who} the {trade} lived well near {place}."
    return "\n".join(lines[:2]) + "\n" + "\n\n".join(wrapped) + "\n\n" + ending + "\n"


def counting(rng: random.Random) -> str:
    start = rng.randrange(0, 10)
    thing = rng.choice(ANIMALS)
    rows = [f"{NUMBER_WORDS[n].capitalize()} {thing} in a row, and one more makes "
            f"{NUMBER_WORDS[n + 1]}." for n in range(start, min(start + 5, 20))]
    return "A counting rhyme\n\n" + "\n".join(rows) + "\n"


def build(seed: int = 0, target: int = TARGET_BYTES) -> str:
    rng = random.Random(seed)
    parts = [PREFACE]
    number = 1
    while sum(len(p) + 1 for p in parts) < target:
        parts.append(counting(rng) if rng.randrange(6) == 0 else tale(rng, number))
        number += 1
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with corpus.txt, write nothing")
    ap.add_argument("--out", default=os.path.join(HERE, "corpus.txt"))
    args = ap.parse_args()
    text = build()
    data = text.encode("ascii")
    if args.check:
        with open(args.out, "rb") as f:
            same = f.read() == data
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from the generator'}")
        return 0 if same else 1
    with open(args.out, "wb") as f:
        f.write(data)
    print(f"{args.out}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
