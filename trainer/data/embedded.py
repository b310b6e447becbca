"""The embedded default corpus: short stories generated from a small grammar, deterministic from a seed.

Written for this project (no third-party text), it needs no files, and its regular structure lets the tiny
default model show a clearly falling loss within a minute on two CPU cores.
"""
from __future__ import annotations

import random
from typing import List

VERSION = "stories-v1"  # part of the tokenization-cache key: bump when the generator changes

_NAMES = ["Mia", "Tom", "Lily", "Ben", "Zoe", "Max", "Ana", "Leo", "Ivy", "Sam", "Nora", "Finn"]
_ANIMALS = ["dog", "cat", "bird", "fox", "rabbit", "duck", "frog", "horse"]
_COLORS = ["red", "blue", "green", "yellow", "little", "shiny", "old", "big"]
_THINGS = ["ball", "kite", "hat", "box", "boat", "book", "cake", "drum"]
_PLACES = ["park", "forest", "beach", "garden", "river", "hill", "town", "farm"]
_FEELINGS = ["happy", "proud", "tired", "excited", "calm", "glad"]
_TIMES = ["the sun went down", "it started to rain", "the stars came out", "dinner was ready"]


def _story(rng: random.Random) -> str:
    name, friend = rng.sample(_NAMES, 2)
    animal, color, thing = rng.choice(_ANIMALS), rng.choice(_COLORS), rng.choice(_THINGS)
    place, feeling, time = rng.choice(_PLACES), rng.choice(_FEELINGS), rng.choice(_TIMES)
    sentences = [
        f"{name} had a {color} {thing}.",
        f"Every day, {name} went to the {place} with the {thing}.",
        f"One day, {name} met a friendly {animal} and a friend named {friend}.",
        rng.choice([
            f"The {animal} wanted to play, so {name} gave the {thing} to {friend}.",
            f"{friend} asked, \"Can I play with your {thing}?\" and {name} said yes.",
            f"The {animal} ran away with the {thing}, and {name} and {friend} ran after it.",
        ]),
        f"They played at the {place} until {time}.",
        f"{name} felt {feeling}, and {friend} felt {feeling} too.",
    ]
    if rng.random() < 0.5:
        sentences.append(f"The next day, they went back to the {place} to play again.")
    return " ".join(sentences)


def embedded_documents(n: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    return [_story(rng) for _ in range(n)]
