"""A repetition-heavy workload for `specdec bench`, generated here from a fixed seed.

Three families, in the shapes where a served model writes again what it was given:
- code-edit: "return the given code with one change" over generated Python functions and
  classes (five shapes, names drawn from word lists);
- extraction: short generated invoices and order emails into one fixed JSON schema, the
  schema the same in every prompt and every value copied from the text;
- multi-turn: conversations built in the chat template whose later user turns quote the
  assistant's earlier answers and ask for them again with a change.

Nothing is read from a dataset: the same seed gives the same prompts, byte for byte.
tests/test_bench_workloads.py checks that no message of any bench prompt is one of the
draft's training prompts.
"""

from __future__ import annotations

import random
from string import Template

from specdec.bench.prompts import BenchPrompt, load_prompts
from specdec.settings import BENCH_WORKLOADS

PROMPTS = "prompts"  # the hand-written prompts of prompts.jsonl
REPETITION = "repetition"
WORKLOADS = (PROMPTS, REPETITION)
ALL_WORKLOADS = "all"  # both, side by side in one run
FAMILIES = ("code-edit", "extraction", "multi-turn")
PER_FAMILY = 10
SEED = 40

NOUNS = ["order", "invoice", "parcel", "ticket", "booking", "sensor", "shipment", "payment",
         "lesson", "recipe", "journey", "device", "account", "review", "delivery", "member"]
VERBS = ["total", "summarise", "collect", "score", "tally", "measure", "count", "price"]
FIELDS = ["name", "email", "city", "postcode", "phone", "country", "title", "amount",
          "quantity", "weight", "reference", "status"]
ERRORS = ["TimeoutError", "ConnectionError", "OSError"]
SUFFIXES = ["Cache", "History", "Log", "Buffer", "Registry"]

CODE_SHAPES: list[tuple[str, list[str]]] = [
    ('''def ${verb}_$nouns($items, rate=$rate):
    """Return the total $noun cost of $items after the bulk discount."""
    total = 0.0
    for $item in $items:
        if $item.quantity <= 0:
            continue
        total += $item.price * $item.quantity
    if total > $threshold:
        total -= total * rate
    return round(total, 2)
''', ["change the discount threshold from $threshold to $threshold2",
      "rename the loop variable `$item` to `entry`",
      "round the total to one decimal place instead of two"]),
    ('''class $Class:
    """Keeps the last $limit $nouns seen for each $key."""

    def __init__(self, limit: int = $limit) -> None:
        self.limit = limit
        self.$nouns: dict[str, list[str]] = {}

    def add(self, $key: str, value: str) -> None:
        bucket = self.$nouns.setdefault($key, [])
        bucket.append(value)
        if len(bucket) > self.limit:
            bucket.pop(0)

    def latest(self, $key: str) -> str | None:
        bucket = self.$nouns.get($key, [])
        return bucket[-1] if bucket else None

    def count(self) -> int:
        return sum(len(bucket) for bucket in self.$nouns.values())
''', ["change the default limit from $limit to $limit2",
      "rename the method `latest` to `newest`",
      "make `count` return the number of ${key}s instead of the number of $nouns"]),
    ('''def parse_${noun}_file(text: str) -> dict[str, str]:
    """Parse the 'key = value' lines of a $noun file, skipping comments."""
    $result: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("$comment"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected 'key = value'")
        key, _, value = line.partition("=")
        $result[key.strip().lower()] = value.strip()
    return $result
''', ["treat lines starting with `;` as comments instead of `$comment`",
      "rename the variable `$result` to `settings`",
      "keep the keys' case instead of lowering it"]),
    ('''def check_$noun($record: dict) -> list[str]:
    """Return the problems of one $noun record (an empty list if it is valid)."""
    problems = []
    for field in ("$field1", "$field2", "$field3"):
        if not $record.get(field):
            problems.append(f"missing {field}")
    if len($record.get("$field1", "")) > $maxlen:
        problems.append("$field1 is longer than $maxlen characters")
    if $record.get("$field3", 0) < 0:
        problems.append("$field3 is negative")
    return problems
''', ["raise the length limit of $field1 from $maxlen to $maxlen2",
      "also require the field `$field4`",
      "rename the parameter `$record` to `row`"]),
    ('''def fetch_${noun}_with_retries(call, attempts: int = $attempts, delay_s: float = $delay):
    """Call `call` until it succeeds, waiting longer after each failed $noun request."""
    import time

    last_error = None
    for attempt in range(attempts):
        try:
            return call()
        except $error as error:
            last_error = error
            time.sleep(delay_s * (2 ** attempt))
    raise RuntimeError(f"gave up after {attempts} attempts") from last_error
''', ["change the default number of attempts from $attempts to $attempts2",
      "catch `$error2` instead of `$error`",
      "wait a constant `delay_s` between attempts instead of doubling it"]),
]

FIRST_NAMES = ["Amara", "Jonas", "Priya", "Tomasz", "Lucia", "Kenji", "Fatima", "Oliver",
               "Ingrid", "Mateo", "Zanele", "Hugo", "Mei", "Rashid", "Elena", "Declan"]
LAST_NAMES = ["Okafor", "Lindqvist", "Raman", "Nowak", "Ferreira", "Tanaka", "Haddad",
              "Brennan", "Solberg", "Alvarez", "Dlamini", "Moreau", "Chen", "Karimi"]
COMPANIES = ["Northwind Supplies", "Bluebell Print Works", "Harbour Lane Bakery",
             "Cedar & Pine Joinery", "Quartz Lab Equipment", "Meadowfield Garden Centre",
             "Silverline Cycles", "Oakridge Office Furniture", "Tidewater Marine Parts"]
PRODUCTS = [("A4 paper, box of 5 reams", 21.5), ("desk lamp with USB port", 34.0),
            ("stainless steel water bottle", 12.75), ("wireless keyboard", 45.9),
            ("oak bookshelf, 5 shelves", 189.0), ("set of 12 coloured markers", 8.4),
            ("bicycle inner tube 700x28", 6.95), ("garden hose, 25 m", 29.99),
            ("ergonomic office chair", 249.0), ("laboratory beaker set", 57.3),
            ("marine rope, 10 m", 18.2), ("sourdough starter kit", 14.5)]
CURRENCIES = ["EUR", "GBP", "USD", "CHF"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
SCHEMA = ('{"customer": string, "company": string, "invoice_number": string, '
          '"date": "YYYY-MM-DD", "currency": string, "items": [{"description": string, '
          '"quantity": integer, "unit_price": number}], "total": number, "due_days": integer}')
EXTRACTION_REQUEST = ("Extract the invoice below into JSON with exactly this schema and no other "
                      "keys:\n" + SCHEMA + "\nReply with the JSON only.\n\n")

# Multi-turn topics: what the user first asks for, and the lines the answer lists.
LISTS: list[tuple[str, list[str]]] = [
    ("a packing list for a $days-day walking trip to $place in $month",
     ["waterproof jacket", "two pairs of wool socks", "a refillable water bottle",
      "a small first-aid kit", "a paper map of the area", "sun cream", "a warm hat",
      "a phone charger and power bank", "comfortable walking boots", "a light rain cover"]),
    ("the steps for $person to set up a shared family calendar",
     ["choose one calendar app everyone can open", "create a calendar named Family",
      "invite each family member by email", "give every person their own colour",
      "add the regular events such as school and sports", "turn on reminders a day ahead",
      "agree who adds new appointments", "check the week together every Sunday"]),
    ("an agenda for a $days-hour planning meeting of the $place team",
     ["welcome and goals of the meeting", "review of last quarter's results",
      "open risks and who owns them", "budget for the next quarter",
      "hiring plans", "customer feedback themes", "decisions and owners",
      "date of the next meeting"]),
    ("a shopping list for a vegetarian dinner for $days guests in $month",
     ["two red onions", "a bag of basmati rice", "a tin of chickpeas", "fresh coriander",
      "a pot of plain yoghurt", "six ripe tomatoes", "a block of halloumi", "lemons",
      "a loaf of flatbread", "dark chocolate for dessert"]),
]
PLACES = ["the Lake District", "the Dolomites", "Madeira", "the Scottish Highlands",
          "the Black Forest", "Snowdonia", "the Pyrenees", "Tasmania"]
PEOPLE = ["my parents", "a family of five", "my grandparents", "our new flatmates"]
CHANGES = ["the third item replaced by $extra", "$extra added as the second item",
           "the last item removed", "the items in reverse order"]


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") and noun[-2] not in "aeiou" else noun + "s"


def _names(rng: random.Random, index: int) -> dict[str, object]:
    noun, other = rng.sample(NOUNS, 2)
    fields = rng.sample(FIELDS, 4)
    errors = rng.sample(ERRORS, 2)
    threshold = rng.choice([50, 100, 150, 200, 250])
    limit, maxlen = rng.choice([5, 10, 20]), rng.choice([40, 64, 80])
    attempts = rng.choice([3, 4, 5])
    return {
        "verb": rng.choice(VERBS), "noun": noun, "nouns": _plural(noun),
        "items": f"{noun}_lines", "item": noun[:3] if index % 2 else "line",
        "rate": rng.choice(["0.05", "0.1", "0.15"]), "threshold": threshold,
        "threshold2": threshold + 25, "Class": noun.capitalize() + rng.choice(SUFFIXES),
        "key": other, "limit": limit, "limit2": limit * 2, "result": f"{noun}_settings",
        "comment": rng.choice(["#", "//"]), "record": noun, "field1": fields[0],
        "field2": fields[1], "field3": fields[2], "field4": fields[3], "maxlen": maxlen,
        "maxlen2": maxlen * 2, "attempts": attempts, "attempts2": attempts + 2,
        "delay": rng.choice(["0.5", "1.0", "0.25"]), "error": errors[0], "error2": errors[1],
    }


def code_edit_prompts(rng: random.Random, count: int = PER_FAMILY) -> list[BenchPrompt]:
    """'Return the code with one change': each shape in turn, with fresh names."""
    prompts = []
    for index in range(count):
        shape, changes = CODE_SHAPES[index % len(CODE_SHAPES)]
        names = _names(rng, index)
        code = Template(shape).substitute(names)
        change = Template(rng.choice(changes)).substitute(names)
        text = (f"Return the following Python code with one change: {change}. Keep everything "
                "else exactly as it is and reply with the complete code only.\n\n"
                f"```python\n{code}```")
        prompts.append(BenchPrompt(f"code-edit-{index + 1:02d}", "code-edit", text,
                                   workload=REPETITION))
    return prompts


def _invoice(rng: random.Random, index: int) -> str:
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    company, currency = rng.choice(COMPANIES), rng.choice(CURRENCIES)
    number = f"INV-{rng.randint(2023, 2025)}-{rng.randint(1, 9999):04d}"
    day, month, year = rng.randint(1, 28), rng.randint(1, 12), rng.randint(2023, 2025)
    lines = [(product, price, rng.randint(1, 6))
             for product, price in rng.sample(PRODUCTS, rng.randint(2, 3))]
    total = round(sum(price * quantity for _, price, quantity in lines), 2)
    due = rng.choice([14, 30, 45, 60])
    date = f"{day} {MONTHS[month - 1]} {year}"
    if index % 3 == 0:  # an email
        items = ", ".join(f"{q} x {d} at {p:.2f} {currency} each" for d, p, q in lines)
        return (f"Subject: Invoice {number}\n\nDear {first} {last},\n\nthank you for your order "
                f"with {company}. Invoice {number}, dated {date}, covers {items}: "
                f"{total:.2f} {currency} in all. Payment is due within {due} days.\n\n"
                f"Kind regards,\nAccounts, {company}")
    if index % 3 == 1:  # a printed invoice
        items = "\n".join(f"- {d}: {q} @ {p:.2f}" for d, p, q in lines)
        return (f"{company.upper()}\nINVOICE {number}\nDate: {date}\nBill to: {first} {last}\n"
                f"Currency: {currency}\n{items}\nTOTAL: {total:.2f}\nTerms: net {due} days")
    items = "; ".join(f"{d} (qty {q}, {p:.2f} per unit)" for d, p, q in lines)
    return (f"Note from {first} {last}: {company} sent me invoice {number} on {date} for "
            f"{items}. It says {total:.2f} {currency} is to be paid in {due} days. Can you "
            "file it?")


def extraction_prompts(rng: random.Random, count: int = PER_FAMILY) -> list[BenchPrompt]:
    """Invoices, emails and notes into the one JSON schema."""
    return [BenchPrompt(f"extraction-{index + 1:02d}", "extraction",
                        EXTRACTION_REQUEST + _invoice(rng, index), workload=REPETITION)
            for index in range(count)]


def _numbered(items: list[str]) -> str:
    return "\n".join(f"{number}. {item[0].upper()}{item[1:]}."
                     for number, item in enumerate(items, start=1))


def _changed(items: list[str], change: int, extra: str) -> list[str]:
    if change == 0:
        return [*items[:2], extra, *items[3:]]
    if change == 1:
        return [items[0], extra, *items[1:]]
    if change == 2:
        return items[:-1]
    return items[::-1]


def multi_turn_prompts(rng: random.Random, count: int = PER_FAMILY) -> list[BenchPrompt]:
    """Three user turns: a list asked for, asked again with a change quoting a line of it,
    then asked a last time quoting both answers."""
    prompts = []
    for index in range(count):
        topic, pool = LISTS[index % len(LISTS)]
        slots = {"days": rng.randint(3, 7), "place": rng.choice(PLACES),
                 "month": rng.choice(MONTHS), "person": rng.choice(PEOPLE)}
        subject = Template(topic).substitute(slots)
        items = rng.sample(pool, rng.randint(5, len(pool) - 2))
        # Extras from the same topic's lines the answer left out.
        first_extra, last_extra = rng.sample([item for item in pool if item not in items], 2)
        change = rng.randrange(len(CHANGES))
        answer = (f"Sure! {subject[0].upper()}{subject[1:]}:\n\n{_numbered(items)}\n\n"
                  "Tell me if you want any changes.")
        changed = _changed(items, change, first_extra)
        asked = Template(CHANGES[change]).substitute(extra=first_extra)
        second = (f"Thanks. You wrote \"{_numbered(items).splitlines()[1]}\". Please give me "
                  f"the whole list again, with {asked}.")
        second_answer = f"Of course. Here is the updated list:\n\n{_numbered(changed)}"
        quoted_first = _numbered(items).splitlines()[0]
        quoted_second = _numbered(changed).splitlines()[-1]
        final = (f"Earlier you listed \"{quoted_first}\" and then \"{quoted_second}\". Write "
                 f"the updated list once more, numbered as before, and add {last_extra} at "
                 "the end.")
        history = (("user", f"Could you write me {subject}?"), ("assistant", answer),
                   ("user", second), ("assistant", second_answer))
        prompts.append(BenchPrompt(f"multi-turn-{index + 1:02d}", "multi-turn", final,
                                   workload=REPETITION, history=history))
    return prompts


def repetition_prompts(seed: int = SEED, per_family: int = PER_FAMILY) -> list[BenchPrompt]:
    """The repetition workload: every family, per_family prompts each, from `seed`."""
    rng = random.Random(seed)
    return [*code_edit_prompts(rng, per_family), *extraction_prompts(rng, per_family),
            *multi_turn_prompts(rng, per_family)]


def workload_prompts(workload: str) -> list[BenchPrompt]:
    """The prompts of `workload`: one of WORKLOADS, or "all" for each in turn."""
    if workload not in BENCH_WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from "
                         f"{', '.join(BENCH_WORKLOADS)}")
    chosen: list[BenchPrompt] = []
    if workload in (PROMPTS, ALL_WORKLOADS):
        chosen += load_prompts()
    if workload in (REPETITION, ALL_WORKLOADS):
        chosen += repetition_prompts()
    return chosen


def bench_texts() -> list[str]:
    """Every message of every bench prompt, of both workloads: the texts the draft's
    training data must never hold."""
    return [content for prompt in workload_prompts(ALL_WORKLOADS)
            for _, content in prompt.messages]
