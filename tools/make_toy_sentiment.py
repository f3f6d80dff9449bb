"""Write examples/data/sentiment_{train,test}.csv: a toy sentiment dataset (columns text, label: pos / neg) of short
review sentences composed from templates with a fixed seed, so it carries no third-party text or licence. The
sentiment lies in the opinion words (an adjective, sometimes a verb), placed among neutral subjects and fillers; the
test split uses the same vocabulary, and no sentence of it appears in the train split.

    python tools/make_toy_sentiment.py
"""
from __future__ import annotations

import csv
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "data"
TRAIN, TEST = 320, 96

SUBJECTS = ["the movie", "the film", "the food", "the service", "the hotel", "the book", "the show", "the staff",
            "the room", "the game", "the music", "the trip", "this phone", "this album", "the ending", "the plot"]
LINKS = ["was", "is", "felt", "seemed", "was really", "is quite", "was very", "turned out"]
ADJECTIVES = {"pos": ["good", "great", "wonderful", "excellent", "lovely", "fun", "amazing", "pleasant", "superb",
                      "delightful"],
              "neg": ["bad", "awful", "terrible", "boring", "poor", "dull", "horrible", "disappointing", "weak",
                      "annoying"]}
VERBS = {"pos": ["i loved it", "we enjoyed it", "i would recommend it", "we will come back"],
         "neg": ["i hated it", "we regretted it", "i would not recommend it", "we will not come back"]}
FILLERS = ["", "", "honestly", "overall", "to be fair", "in the end", "for the price", "at first"]


def sentence(rng: random.Random, label: str) -> str:
    parts = [rng.choice(FILLERS), rng.choice(SUBJECTS), rng.choice(LINKS), rng.choice(ADJECTIVES[label])]
    if rng.random() < 0.4:
        parts += ["and", rng.choice(VERBS[label])]
    return " ".join(p for p in parts if p)


def rows(rng: random.Random, count: int, exclude: set) -> list[tuple[str, str]]:
    out, seen = [], set(exclude)
    while len(out) < count:
        label = "pos" if len(out) % 2 == 0 else "neg"
        text = sentence(rng, label)
        if text not in seen:
            seen.add(text)
            out.append((text, label))
    rng.shuffle(out)
    return out


def write(path: Path, data: list[tuple[str, str]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["text", "label"])
        writer.writerows(data)


def main() -> None:
    rng = random.Random(20)
    train = rows(rng, TRAIN, set())
    test = rows(rng, TEST, {text for text, _ in train})
    write(OUT / "sentiment_train.csv", train)
    write(OUT / "sentiment_test.csv", test)
    print(f"{OUT}: sentiment_train.csv ({len(train)} rows), sentiment_test.csv ({len(test)} rows)")


if __name__ == "__main__":
    main()
