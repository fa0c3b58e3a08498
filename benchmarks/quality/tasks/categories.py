"""Word categories as multiple choice, BIG-bench-style: pick the one word of four that belongs to
a named category, scored by log-likelihood ranking (`choice_accuracy`).

Every word is seen in train, as the right answer and as a distractor; eval asks about
(category, four-word set) combinations that train never shows, in any order.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .base import ChoiceItem, Example, Task

# category -> (how the prompt names it, its words). Words are lowercase, single, common, and belong
# to one category only: no "orange" (fruit, colour), "kiwi" (fruit, bird), "turkey", "organ", "bass".
CATEGORIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "animal": (
        "an animal",
        (
            "dog",
            "cat",
            "horse",
            "cow",
            "sheep",
            "goat",
            "lion",
            "tiger",
            "elephant",
            "rabbit",
            "wolf",
            "bear",
            "fox",
            "monkey",
            "giraffe",
            "zebra",
        ),
    ),
    "fruit": (
        "a fruit",
        (
            "apple",
            "banana",
            "pear",
            "plum",
            "grape",
            "mango",
            "melon",
            "strawberry",
            "pineapple",
            "coconut",
            "papaya",
            "fig",
            "raspberry",
            "blueberry",
            "watermelon",
            "guava",
        ),
    ),
    "colour": (
        "a colour",
        (
            "red",
            "blue",
            "green",
            "yellow",
            "purple",
            "pink",
            "brown",
            "black",
            "white",
            "grey",
            "crimson",
            "scarlet",
            "beige",
            "turquoise",
            "indigo",
            "maroon",
        ),
    ),
    "country": (
        "a country",
        (
            "france",
            "germany",
            "spain",
            "italy",
            "japan",
            "india",
            "brazil",
            "canada",
            "mexico",
            "egypt",
            "kenya",
            "peru",
            "norway",
            "sweden",
            "greece",
            "poland",
        ),
    ),
    "tool": (
        "a tool",
        (
            "hammer",
            "saw",
            "drill",
            "wrench",
            "screwdriver",
            "chisel",
            "pliers",
            "shovel",
            "rake",
            "axe",
            "spanner",
            "hoe",
            "trowel",
            "crowbar",
            "scissors",
            "mallet",
        ),
    ),
    "body part": (
        "a body part",
        (
            "arm",
            "leg",
            "hand",
            "foot",
            "knee",
            "elbow",
            "shoulder",
            "finger",
            "toe",
            "nose",
            "ear",
            "neck",
            "chin",
            "ankle",
            "wrist",
            "thumb",
        ),
    ),
    "vehicle": (
        "a vehicle",
        (
            "car",
            "bus",
            "truck",
            "bicycle",
            "train",
            "tram",
            "van",
            "taxi",
            "tractor",
            "motorcycle",
            "scooter",
            "boat",
            "helicopter",
            "lorry",
            "ambulance",
            "canoe",
        ),
    ),
    "instrument": (
        "a musical instrument",
        (
            "piano",
            "guitar",
            "violin",
            "drum",
            "flute",
            "trumpet",
            "cello",
            "harp",
            "clarinet",
            "saxophone",
            "trombone",
            "banjo",
            "oboe",
            "tuba",
            "ukulele",
            "accordion",
        ),
    ),
    "weather": (
        "a kind of weather",
        (
            "rain",
            "snow",
            "hail",
            "fog",
            "wind",
            "storm",
            "thunder",
            "lightning",
            "drizzle",
            "sleet",
            "mist",
            "frost",
            "sunshine",
            "blizzard",
            "hurricane",
            "tornado",
        ),
    ),
    "furniture": (
        "a piece of furniture",
        (
            "table",
            "chair",
            "sofa",
            "bed",
            "desk",
            "wardrobe",
            "shelf",
            "bench",
            "stool",
            "cupboard",
            "dresser",
            "couch",
            "bookcase",
            "armchair",
            "sideboard",
            "ottoman",
        ),
    ),
}

_ALL_WORDS = [word for _, words in CATEGORIES.values() for word in words]
assert len(_ALL_WORDS) == len(set(_ALL_WORDS)), "a word is listed under two categories"

_Key = tuple[str, frozenset[str]]


def _item(rng: random.Random, category: str, word: str) -> tuple[_Key, ChoiceItem]:
    """`word` (of `category`) with one word from each of three other categories, in random order."""
    others = rng.sample(sorted(c for c in CATEGORIES if c != category), 3)
    words = [word] + [rng.choice(CATEGORIES[c][1]) for c in others]
    rng.shuffle(words)
    prompt = f"Which word is {CATEGORIES[category][0]}: {', '.join(words)}? Answer:"
    return (category, frozenset(words)), ChoiceItem(prompt, tuple(f" {w}" for w in words), words.index(word))


def _draw(rng: random.Random, n: int, taken: set[_Key], answers: Callable[[], tuple[str, str]]) -> list[ChoiceItem]:
    """`n` items whose (category, word set) is in neither `taken` nor each other (added to `taken`).

    `answers()` gives each item's (category, right word); only its distractors are redrawn on a clash.
    """
    items: list[ChoiceItem] = []
    for _ in range(n):
        category, word = answers()
        for _ in range(1000):
            key, item = _item(rng, category, word)
            if key not in taken:
                break
        else:
            raise ValueError(f"could not draw a new item for {word!r} ({category}) after {len(taken)} items")
        taken.add(key)
        items.append(item)
    return items


def category_choice(seed: int, n_train: int, n_eval: int) -> Task:
    """Which of four words, each from a different category, belongs to the named category.

    Prompt ``"Which word is a fruit: table, plum, green, france? Answer:"``; 4 choices like
    ``" plum"``. Train is ``Example(prompt, " plum")`` (the right choice), eval the `ChoiceItem`s;
    see `choice_accuracy`. Eval draws its right answers at random; train deals them from a
    reshuffled deck of every (category, word), so once ``n_train`` reaches the 160 words each one is
    a right answer in train, as often as any other give or take one. No (category, word set) is in
    both train and eval.
    """
    rng = random.Random(f"category_choice/{seed}")
    pairs = [(category, word) for category, (_, words) in CATEGORIES.items() for word in words]
    deck: list[tuple[str, str]] = []

    def dealt() -> tuple[str, str]:
        if not deck:
            deck.extend(rng.sample(pairs, len(pairs)))
        return deck.pop()

    taken: set[_Key] = set()
    eval_ = _draw(rng, n_eval, taken, lambda: rng.choice(pairs))
    train = _draw(rng, n_train, taken, dealt)
    train = [Example(item.prompt, item.choices[item.label]) for item in train]
    return Task("category_choice", "choice", train, eval_)
