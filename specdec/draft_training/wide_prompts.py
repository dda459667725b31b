"""A wider prompt set for distillation: requests phrased the way people write them.

The templated set (`prompts.py`) repeats a few sentence shapes over a list of subjects; a
draft trained only on it learns those shapes and accepts less on real requests. This set
combines many request shapes (advice, messages to write, rewrites, step-by-step how-tos,
story openings, why/how questions, code with named functions, classes, queries and
scripts) with their own slot lists. Deterministic and split by the same text hash, and
kept disjoint from the bench prompts by tests/test_bench.py.
"""

from __future__ import annotations

import random

from specdec.draft_training.prompts import Prompt, sample_prompts

PEOPLE = ["my brother", "my best friend", "my grandmother", "a colleague", "my neighbour",
          "my teacher", "my boss", "my cousin", "my daughter", "my son", "my partner",
          "an old school friend", "my landlord", "my team", "my aunt"]
OCCASIONS = ["graduated from university", "had a baby", "retired after thirty years",
             "moved to a new city", "got married", "passed a driving test", "opened a bakery",
             "finished a marathon", "recovered from an illness", "started a new school",
             "won a chess tournament", "bought a first house"]
MESSAGES = ["a thank-you note", "a short apology", "a birthday message", "a polite reminder",
            "an invitation to a picnic", "a message asking for advice",
            "a note declining an invitation", "a farewell message", "a welcome message",
            "a request for a day off"]
GOALS = ["sleep better", "save money each month", "learn to cook simple meals",
         "read more books", "drink more water", "get up earlier", "learn a new language",
         "spend less time on my phone", "keep my desk tidy", "stretch every day",
         "learn to swim", "study for exams without stress", "eat more vegetables",
         "make new friends in a new city", "walk ten thousand steps a day"]
TASKS = ["bake banana bread", "plant tomatoes on a balcony", "clean a laptop keyboard",
         "tie a tie", "make a paper airplane", "brew tea properly", "pack for a camping trip",
         "set up a fish tank", "prepare for a job interview", "write a cover letter",
         "make a budget spreadsheet", "repaint a wooden chair", "start a compost bin",
         "learn to juggle", "organise a bookshelf", "make pancakes", "iron a shirt",
         "wash a wool sweater", "build a birdhouse", "plan a road trip"]
EVENTS = ["a birthday party for a seven-year-old", "a team lunch for twelve people",
          "a picnic in the park", "a weekend trip to the mountains", "a board game night",
          "a small wedding", "a school bake sale", "a family reunion", "a book club meeting",
          "a charity run"]
ROUGH_TEXTS = ["the shop is closed monday because of repairs, sorry for any trouble",
               "we need volunteers for saturday, bring gloves, meet at nine",
               "your order is late because the truck broke down, it will come tomorrow",
               "the wifi password changed, ask reception for the new one",
               "please stop leaving dishes in the sink it is not fair to others",
               "the trip is cancelled due to the weather, refunds next week",
               "class starts at ten now not nine, room twelve"]
STYLES = ["more formal", "friendlier", "shorter", "clearer", "more enthusiastic",
          "easier for a child to understand"]
HEROES = ["a lonely lighthouse", "a mouse who wants to fly", "an old fisherman",
          "a girl who can talk to birds", "a forgetful robot", "a family of hedgehogs",
          "a boy who collects stones", "a tired delivery driver", "a cat detective",
          "a young astronaut", "a kind giant", "a painter who lost her colours",
          "a village baker", "a sleepy bear", "a runaway balloon", "a retired pirate",
          "a penguin who hates the cold", "a librarian with a secret", "a pair of twin sisters",
          "a squirrel who hoards books"]
WANTS = ["wants to see the ocean", "is looking for a lost friend", "wants to win a race",
         "finds a door that was not there yesterday", "receives a mysterious parcel",
         "must cross a frozen lake", "wants to learn to sing", "builds a machine",
         "gets lost in a big market", "tries to stop a storm", "makes an unlikely friend",
         "has to keep a secret", "wakes up a hundred years later"]
OPENINGS = ["The door creaked open, and a cold wind swept into the room.",
            "Nobody in the village had ever seen a purple moon before.",
            "On the morning of her tenth birthday, Mia found a key under her pillow.",
            "The last bus of the night was completely empty, except for one passenger.",
            "The robot had been waiting in the garden for exactly three hundred years.",
            "It was raining so hard that the river began to climb the stairs.",
            "The letter was written in a language that nobody could read.",
            "Every night at midnight, the statue in the square changed its pose."]
TONES = ["funny", "sad", "exciting", "calm", "mysterious", "heart-warming"]
PHENOMENA = ["ice float on water", "we have seasons", "the ocean taste salty",
             "cats purr", "bread rise", "we dream", "the moon change shape",
             "metal feel cold", "onions make us cry", "birds migrate", "we get hiccups",
             "stars twinkle", "soap clean our hands", "volcanoes erupt", "plants need sunlight",
             "the wind blow", "our hearts beat faster when we run", "fish breathe under water",
             "rust form on iron", "popcorn pop"]
MACHINES = ["a microwave oven", "a bicycle gear", "an electric motor", "a camera",
            "a solar panel", "a thermostat", "a compass", "a hot-air balloon", "a wind turbine",
            "a dishwasher", "a touch screen", "GPS navigation", "a submarine", "an elevator"]
FIGURES = ["Isaac Newton", "Ada Lovelace", "Leonardo da Vinci", "Nelson Mandela",
           "Charles Darwin", "Cleopatra", "Albert Einstein", "Florence Nightingale",
           "Galileo Galilei", "Mahatma Gandhi", "Frida Kahlo", "Nikola Tesla", "Jane Austen",
           "Wolfgang Amadeus Mozart", "Rosalind Franklin", "Genghis Khan"]
HISTORY = ["the fall of the Berlin Wall", "the invention of writing", "the Industrial Revolution",
           "the first Moon landing", "the building of the pyramids", "the Silk Road",
           "the age of exploration", "the end of the Roman Empire", "the Black Death",
           "the invention of the printing press"]
PAIRS = [("a virus", "a bacterium"), ("a frog", "a toad"), ("a comet", "an asteroid"),
         ("weather", "seasons"), ("a lake", "a pond"), ("speed", "velocity"),
         ("an alligator", "a crocodile"), ("mass", "weight"), ("a hurricane", "a tornado"),
         ("a simile", "a metaphor"), ("a democracy", "a monarchy"), ("DNA", "RNA")]
FUNCTIONS = [("count_words", "counts the words in a string"),
             ("is_even", "returns True when a number is even"),
             ("celsius_to_kelvin", "converts Celsius to Kelvin"),
             ("flatten", "flattens a list of lists"),
             ("chunk", "splits a list into chunks of size n"),
             ("longest_word", "returns the longest word in a sentence"),
             ("median", "returns the median of a list of numbers"),
             ("gcd", "computes the greatest common divisor of two integers"),
             ("is_anagram", "checks whether two words are anagrams"),
             ("title_case", "capitalises the first letter of each word"),
             ("count_chars", "counts how often each character appears in a string"),
             ("second_largest", "returns the second largest number in a list"),
             ("rotate", "rotates a list by k positions"),
             ("digits_sum", "returns the sum of the digits of a number"),
             ("unique_sorted", "returns the sorted unique values of a list"),
             ("fizzbuzz", "prints the numbers 1 to 100 with Fizz and Buzz rules")]
LANGS = ["Python", "Python", "Python", "JavaScript", "Java", "C", "C++", "Go", "Rust",
         "TypeScript", "Ruby"]
CLASSES = [("BankAccount", "deposit, withdraw and balance"), ("Queue", "enqueue and dequeue"),
           ("Rectangle", "area and perimeter"), ("Counter", "increment, decrement and reset"),
           ("Library", "add_book, remove_book and list_books"),
           ("Timer", "start, stop and elapsed"), ("Point", "distance_to and translate"),
           ("TodoList", "add, complete and pending")]
TABLES = [("employees(id, name, department, salary)", "the average salary per department"),
          ("books(id, title, author, year)", "all books published after 2000, newest first"),
          ("students(id, name, grade)", "the three students with the highest grades"),
          ("products(id, name, price, stock)", "products that are out of stock"),
          ("orders(id, customer, total, created_at)", "the number of orders per month"),
          ("movies(id, title, rating, genre)", "the best rated movie in each genre")]
SHELL = ["renames every .jpeg file in a folder to .jpg", "prints the ten largest files in a folder",
         "backs up a folder into a dated zip file", "counts the lines of every .py file",
         "deletes log files older than seven days", "prints the current date and disk usage"]
CONCEPTS = ["recursion", "a hash map", "a for loop and a while loop", "an API",
            "object-oriented programming", "exceptions", "a linked list", "Big O notation",
            "git branches", "unit tests", "a dictionary in Python", "list comprehensions",
            "variables and constants", "a REST API", "an array and a linked list"]

TEMPLATES: dict[str, list[str]] = {
    "chat": [
        "{person_cap} just {occasion}. What could I say in a card for them?",
        "Can you help me write {message} to {person}?",
        "I want to {goal}. Could you give me a simple plan for the first two weeks?",
        "What is the easiest way to {task}? Please explain step by step.",
        "I am organising {event}. What should I prepare?",
        "Rewrite this so it sounds {style}: '{rough}'",
        "Turn this into a short, clear notice: {rough}.",
        "I keep failing to {goal}. What am I doing wrong, and what would help?",
        "Could you give me a checklist for {event}?",
        "My {relation} and I had an argument about who does the chores. How can we settle it?",
        "Write a short message to {person} explaining that I will be late today.",
        "I only have twenty minutes. How can I {task}?",
        "Give me five ideas to make {event} more fun.",
        "What should I keep in mind before I {task} for the first time?",
    ],
    "story": [
        "Write a short story about {hero} who {want}.",
        "Tell a {tone} story about {hero}.",
        "Write a story that starts with: '{opening}'",
        "{opening} Continue the story.",
        "Tell me a bedtime story about {hero} who {want}.",
        "Write a {tone} fairy tale in which {hero} {want}.",
        "Write a short scene where {hero} meets {hero2} for the first time.",
        "Write a poem-like story about {hero} in four short paragraphs.",
    ],
    "factual": [
        "Why does {phenomenon}?", "How does {machine} work?",
        "Who was {figure}, and why is {pronoun} remembered?",
        "What happened during {history}?", "What is the difference between {a} and {b}?",
        "Explain in simple words why {phenomenon}.",
        "What were the consequences of {history}?",
        "Describe the life and work of {figure} in a few sentences.",
        "How was {machine} invented, and how does it work today?",
    ],
    "code": [
        "Write a {lang} function {fname} that {fdesc}.",
        "Write a {lang} function {fname}(...) that {fdesc}, with a docstring and an example.",
        "Implement a {cls} class in {lang} with the methods {methods}.",
        "Write a SQL query for the table {table} that returns {query}.",
        "Write a bash script that {shell}.",
        "Explain {concept} with a short {lang} example.",
        "What is {concept}? Show me an example in {lang}.",
        "I wrote a {lang} function that {fdesc}, but it is slow. How can I make it faster?",
        "Write unit tests in {lang} for a function that {fdesc}.",
    ],
}
RELATIONS = ["flatmate", "partner", "brother", "sister", "roommate"]


def _fill(template: str, rng: random.Random) -> str:
    person = rng.choice(PEOPLE)
    fname, fdesc = rng.choice(FUNCTIONS)
    cls, methods = rng.choice(CLASSES)
    table, query = rng.choice(TABLES)
    a, b = rng.choice(PAIRS)
    figure = rng.choice(FIGURES)
    heroes = rng.sample(HEROES, 2)
    return template.format(
        person=person, person_cap=person[0].upper() + person[1:],
        occasion=rng.choice(OCCASIONS), message=rng.choice(MESSAGES), goal=rng.choice(GOALS),
        task=rng.choice(TASKS), event=rng.choice(EVENTS), style=rng.choice(STYLES),
        rough=rng.choice(ROUGH_TEXTS), relation=rng.choice(RELATIONS), hero=heroes[0],
        hero2=heroes[1], want=rng.choice(WANTS), opening=rng.choice(OPENINGS),
        tone=rng.choice(TONES), phenomenon=rng.choice(PHENOMENA), machine=rng.choice(MACHINES),
        figure=figure, pronoun="she" if figure in _WOMEN else "he", history=rng.choice(HISTORY),
        a=a, b=b, lang=rng.choice(LANGS), fname=fname, fdesc=fdesc, cls=cls, methods=methods,
        table=table, query=query, shell=rng.choice(SHELL), concept=rng.choice(CONCEPTS))


_WOMEN = {"Ada Lovelace", "Cleopatra", "Florence Nightingale", "Frida Kahlo", "Jane Austen",
          "Rosalind Franklin"}


def generate_wide_prompts(count: int = 6000, seed: int = 1) -> list[Prompt]:
    return sample_prompts(TEMPLATES, _fill, count, seed)
