"""The project's own prompt set for distilling the draft, generated from templates.

Deterministic (fixed seed) and split by a hash of the text, so the held-out prompts are
the same on every machine and training never sees them. Categories mirror what users ask
an instruct model: instructions, chat, short stories, explanations, factual questions and
simple code.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

SUBJECTS = [
    "volcanoes", "the moon", "honey bees", "bicycles", "the water cycle", "photosynthesis",
    "ancient Egypt", "the printing press", "electric cars", "rainbows", "coffee", "chess",
    "the Roman Empire", "black holes", "recycling", "the human heart", "penguins", "glaciers",
    "the internet", "vaccines", "earthquakes", "solar panels", "dinosaurs", "the ocean tides",
    "music theory", "gardening", "the stock market", "bread baking", "airplanes", "dolphins",
    "the French Revolution", "clouds", "magnets", "the immune system", "deserts", "trains",
    "the Great Wall of China", "batteries", "friendship", "sleep", "football", "libraries",
    "mountains", "rain forests", "the Olympic Games", "owls", "telescopes", "chocolate",
    "the alphabet", "bridges", "wind turbines", "mushrooms", "the periodic table", "kites",
    "lighthouses", "robots", "the Renaissance", "maps", "money", "elephants", "snow",
    "computers", "vitamins", "the solar system", "jazz", "castles", "tea", "spiders",
    "climate change", "democracy", "the brain", "fire", "pirates", "yoga", "rivers",
]
CHARACTERS = [
    "a curious fox", "an old lighthouse keeper", "a robot who loves flowers", "a young wizard",
    "a lost puppy", "a brave knight", "a shy dragon", "two best friends", "a clever girl",
    "a grumpy cat", "a tiny ant", "a retired astronaut", "a baker", "a talking tree",
    "a sailor", "a little cloud", "a detective", "a farmer", "a musician", "a turtle",
]
PLACES = [
    "a small village", "the deep sea", "a busy city", "a snowy forest", "a desert island",
    "a space station", "an old library", "a mountain top", "a hidden garden", "a castle",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the largest item in a list",
    "counts the vowels in a word", "computes the factorial of n", "sums the even numbers in a list",
    "converts Celsius to Fahrenheit", "removes duplicates from a list",
    "checks if a word is a palindrome",
    "returns the n-th Fibonacci number", "sorts a list of names", "counts words in a sentence",
    "merges two dictionaries", "finds the average of a list", "reads a file and prints each line",
    "capitalizes every word in a sentence", "returns the square of each number in a list",
]
LANGUAGES = ["Python", "JavaScript", "Python", "C", "Python", "Java", "Rust", "SQL"]

TEMPLATES = {
    "instruction": [
        "Give me three tips about {s}.", "Write a short list of facts about {s}.",
        "Summarize what people should know about {s} in two sentences.",
        "Write a haiku about {s}.", "Give me a fun quiz question about {s}.",
        "Describe {s} to a five-year-old.", "List the pros and cons of {s}.",
        "Write a short poem about {s}.", "Suggest a weekend activity related to {s}.",
        "Write a tweet about {s}.",
    ],
    "chat": [
        "Hi! Can you tell me something interesting about {s}?", "I'm bored. Let's talk about {s}.",
        "What do you think about {s}?", "My friend says {s} are boring. Do you agree?",
        "Hello, how are you today?", "Can you help me plan my day?",
        "I feel a bit tired today. Any advice?", "Thanks for your help earlier!",
        "Do you like {s}?", "Tell me a joke about {s}.",
    ],
    "story": [
        "Write a short story about {c} in {p}.", "Tell me a bedtime story about {c}.",
        "Write the opening paragraph of a story set in {p}.",
        "Write a story in which {c} discovers {s}.", "Write a fable about {c} and {s}.",
    ],
    "explanation": [
        "Explain how {s} work.", "Why is {s} important?", "Explain {s} in simple terms.",
        "How does {s} affect our daily lives?", "What is the history of {s}?",
        "Explain the science behind {s}.",
    ],
    "factual": [
        "What is the capital of {country}?", "Who invented {invention}?",
        "How many legs does a {animal} have?", "What language is spoken in {country}?",
        "When did people first learn about {s}?", "What is {s} made of?",
        "Where can you find {s}?", "What is the largest {thing}?",
    ],
    "code": [
        "Write a {lang} function that {task}.", "Show me {lang} code that {task}.",
        "Explain this idea and write {lang} code: a function that {task}.",
        "How do I write a program in {lang} that {task}?",
    ],
}
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Italy", "Egypt",
             "Norway", "Mexico", "Australia", "Spain", "Germany", "Peru", "Vietnam", "Greece"]
INVENTIONS = ["the telephone", "the light bulb", "the printing press", "the airplane",
              "the radio", "the steam engine", "the World Wide Web", "the telescope"]
ANIMALS = ["spider", "dog", "bird", "insect", "horse", "octopus", "crab", "starfish"]
THINGS = ["planet in the solar system", "ocean on Earth", "animal on land", "desert",
          "country by area", "mountain in the world", "lake in Africa", "bone in the body"]


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str

    @property
    def held_out(self) -> bool:
        """About 1 in 20 prompts, chosen by a hash of the text, never used for training."""
        return hashlib.sha256(self.text.encode()).digest()[0] < 13


def sample_prompts(templates: dict[str, list[str]], fill: Callable[[str, random.Random], str],
                   count: int, seed: int) -> list[Prompt]:
    """Up to `count` distinct prompts, categories in turn, each a template filled by `fill`."""
    rng = random.Random(seed)
    seen: set[str] = set()
    prompts: list[Prompt] = []
    categories = list(templates)
    attempts = 0
    while len(prompts) < count and attempts < count * 50:
        attempts += 1
        category = categories[attempts % len(categories)]
        text = fill(rng.choice(templates[category]), rng)
        if text not in seen:
            seen.add(text)
            prompts.append(Prompt(category, text))
    return prompts


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        s=rng.choice(SUBJECTS), c=rng.choice(CHARACTERS), p=rng.choice(PLACES),
        lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS),
        country=rng.choice(COUNTRIES), invention=rng.choice(INVENTIONS),
        animal=rng.choice(ANIMALS), thing=rng.choice(THINGS))


def generate_prompts(count: int = 6000, seed: int = 0) -> list[Prompt]:
    return sample_prompts(TEMPLATES, _fill, count, seed)


def split(prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    train = [p for p in prompts if not p.held_out]
    held_out = [p for p in prompts if p.held_out]
    return train, held_out
