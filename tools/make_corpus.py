"""Generate the bundled training text, `gtp_jax/data/corpus.txt`.

The text is English-like prose drawn from a small weighted grammar: five recurring topics
(rivers, machines, gardens, stars, cities), each written as short essays in the present
tense, stories in the past tense with dialogue, and notes with simple numbers. It is
original, ASCII only, and a pure function of `SEED`, so rerunning this script rewrites the
file byte for byte.

Usage: python tools/make_corpus.py
"""

from __future__ import annotations

import random
import textwrap
from dataclasses import dataclass
from pathlib import Path

SEED = 20240611
TARGET_BYTES = 300_000
LINE_WIDTH = 76
CORPUS_PATH = Path(__file__).resolve().parents[1] / "gtp_jax" / "data" / "corpus.txt"

# --------------------------------------------------------------------------- vocabulary
# Word lists are written as plain strings so the tables stay compact under `ruff format`.


def words(text: str) -> tuple[str, ...]:
    """Whitespace-separated words, in order."""
    return tuple(text.split())


def phrases(text: str) -> tuple[str, ...]:
    """'|'-separated phrases, in order."""
    return tuple(phrase.strip() for phrase in text.split("|"))


def word_forms(text: str) -> dict[str, str]:
    """'base:form' pairs, e.g. an irregular plural or past tense for each base word."""
    return dict(pair.split(":") for pair in text.split())


PEOPLE = words("""
    child woman man farmer teacher traveller stranger friend
    sister brother mother father worker student keeper neighbour
""")
NAMES = words(
    "Anna Tomas Mira Jonah Elena Samuel Lucy Peter Clara Oscar Nora Felix Ruth Hugo Ida Leo"
)
ADJECTIVES = words("""
    old new small large quiet bright dark cold warm long short slow quick strange simple
    gentle heavy green blue red grey white black deep wide narrow tall distant ancient young
    patient careful busy empty silent soft clear golden tired happy proud curious plain wild
    calm lonely
""")
ADVERBS = words("""
    slowly quickly quietly always often sometimes carefully gently softly again still nearly
    suddenly together easily rarely
""")
PREPOSITIONS = words("""
    in on under over near beside behind across through along above below toward around past
    beyond
""")
TIME_PHRASES = phrases("""
    in the morning | at night | after the rain | before dawn | every spring | in winter |
    each evening | long ago | for many years | in the summer | at noon | on most days |
    by the end of the day | in the autumn
""")
SPEECH_VERBS = words("said replied answered whispered called added")
NUMBER_WORDS = words("""
    zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen
    fifteen sixteen seventeen eighteen nineteen twenty
""")

IRREGULAR_PLURALS = word_forms("child:children woman:women man:men leaf:leaves fish:fish")
IRREGULAR_PASTS = word_forms("""
    bend:bent break:broke build:built buy:bought cut:cut dig:dug draw:drew drive:drove
    fall:fell feed:fed find:found grow:grew hold:held hum:hummed keep:kept leave:left
    light:lit map:mapped ring:rang rise:rose run:ran see:saw sell:sold shake:shook
    shine:shone sing:sang sleep:slept spin:spun spread:spread stop:stopped swim:swam wake:woke
""")


@dataclass(frozen=True)
class Topic:
    """The words that keep one topic's sentences about the same things."""

    title: str
    nouns: tuple[str, ...]
    places: tuple[str, ...]
    intransitive_verbs: tuple[str, ...]
    transitive_verbs: tuple[str, ...]
    adjectives: tuple[str, ...]
    questions: tuple[str, ...]
    units: tuple[str, ...]


TOPICS = (
    Topic(
        title="Rivers",
        nouns=words("""
            river stream stone fish bridge boat current reed willow mill flood island heron
            frog pebble wave
        """),
        places=words("bank valley delta shore ford marsh spring lake"),
        intransitive_verbs=words("flow bend rise fall wander shine wait turn run swim drift rest"),
        transitive_verbs=words("cross carry follow cut fill feed watch reach wash push find leave"),
        adjectives=words("muddy shallow swift cool winding clean wet"),
        questions=phrases("""
            Where does the river go | Why is the water so cold | Can you see the fish |
            Who built the bridge | How deep is the stream
        """),
        units=words("metres boats stones fish bridges"),
    ),
    Topic(
        title="Machines",
        nouns=words("""
            engine wheel gear lever clock pump wire spring piston bolt valve belt motor switch
            hammer lamp
        """),
        places=words("workshop factory cellar yard shed basement station"),
        intransitive_verbs=words(
            "turn spin hum stop start break rattle tick rest shake click work"
        ),
        transitive_verbs=words(
            "drive lift measure build repair press hold move pull clean test open"
        ),
        adjectives=words("rusty steel electric noisy precise broken oiled"),
        questions=phrases("""
            How does the engine work | Why did the clock stop | Can you repair the pump |
            What does this lever do | Who built the machine
        """),
        units=words("gears wheels bolts turns hours"),
    ),
    Topic(
        title="Gardens",
        nouns=words("""
            garden flower rose tree seed root leaf bee path wall gate hedge apple vine spade
            bird
        """),
        places=words("orchard meadow greenhouse lawn border pond field"),
        intransitive_verbs=words(
            "grow bloom fade climb rest open sway sleep wait ripen sing spread"
        ),
        transitive_verbs=words(
            "plant water dig prune gather pick tend cover keep visit feed watch"
        ),
        adjectives=words("fragrant leafy sunny ripe tangled tidy fresh"),
        questions=phrases("""
            When will the roses bloom | Why are the leaves yellow | Can we plant the seeds now |
            Where do the bees sleep | How tall is the tree
        """),
        units=words("seeds apples roses trees rows"),
    ),
    Topic(
        title="Stars",
        nouns=words("""
            star planet moon comet sky telescope orbit cloud galaxy astronomer sun horizon
            constellation lantern meteor map
        """),
        places=words("hill observatory roof desert mountain tower plain"),
        intransitive_verbs=words(
            "shine burn glow drift appear vanish rise fall turn move wait fade"
        ),
        transitive_verbs=words(
            "observe map count follow name measure find see study watch draw mark"
        ),
        adjectives=words("faint brilliant far cold silver tiny endless"),
        questions=phrases("""
            How far away is the moon | Why do the stars shine | Can you name that planet |
            Where does the comet go | How many stars are there
        """),
        units=words("stars planets nights years moons"),
    ),
    Topic(
        title="Cities",
        nouns=words("""
            city street tower market square window roof lamp train crowd house door road
            library merchant bell
        """),
        places=words("harbour station park corner district avenue quarter"),
        intransitive_verbs=words(
            "gather wake wait sleep shine ring close open hurry rest grow change"
        ),
        transitive_verbs=words(
            "build sell buy paint visit cross guard light open close watch fill"
        ),
        adjectives=words("crowded noisy narrow stone modern lively dusty"),
        questions=phrases("""
            Where does this street go | When does the market open | Who lives in the tower |
            How old is the library | Can you hear the bells
        """),
        units=words("streets houses people towers lamps"),
    ),
)

# --------------------------------------------------------------------------- morphology


def plural(noun: str) -> str:
    """The plural form of a countable noun."""
    if noun in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[noun]
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "sh", "ch", "x", "z")):
        return noun + "es"
    return noun + "s"


def third_person(verb: str) -> str:
    """The present-tense form used with a singular subject."""
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        return verb + "es"
    return verb + "s"


def past_tense(verb: str) -> str:
    """The simple past form of a verb."""
    if verb in IRREGULAR_PASTS:
        return IRREGULAR_PASTS[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def conjugate(verb: str, *, singular: bool, past: bool) -> str:
    """The verb form agreeing with the subject's number in the given tense."""
    if past:
        return past_tense(verb)
    return third_person(verb) if singular else verb


def copula(*, singular: bool, past: bool) -> str:
    """The right form of "to be"."""
    if past:
        return "was" if singular else "were"
    return "is" if singular else "are"


def with_article(phrase: str) -> str:
    """Prefix "a" or "an", whichever suits the first sound."""
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def capitalise(sentence: str) -> str:
    """Uppercase only the first character (str.capitalize would lowercase names)."""
    return sentence[:1].upper() + sentence[1:]


# --------------------------------------------------------------------------- grammar


class Grammar:
    """Weighted sentence rules for one topic, driven by a shared random generator."""

    def __init__(self, rng: random.Random, topic: Topic) -> None:
        self.rng = rng
        self.topic = topic

    def pick(self, options: tuple[str, ...]) -> str:
        return self.rng.choice(options)

    def chance(self, probability: float) -> bool:
        return self.rng.random() < probability

    def adjective(self) -> str:
        # Topic adjectives are weighted up so each essay has its own flavour.
        return self.pick(self.topic.adjectives if self.chance(0.4) else ADJECTIVES)

    def noun(self) -> str:
        return self.pick(self.topic.nouns)

    def described_noun(self, noun: str, *, singular: bool) -> str:
        """The noun in the right number, sometimes with an adjective in front."""
        form = noun if singular else plural(noun)
        return f"{self.adjective()} {form}" if self.chance(0.45) else form

    def noun_phrase(self, noun: str, *, singular: bool, depth: int = 0) -> str:
        described = self.described_noun(noun, singular=singular)
        if singular:
            determiner = self.pick(("the", "the", "the", "a", "this", "that", "every", "one"))
            phrase = with_article(described) if determiner == "a" else f"{determiner} {described}"
        else:
            determiner = self.pick(("the", "the", "some", "many", "these", "those", "all", ""))
            phrase = f"{determiner} {described}".lstrip()
        if depth == 0 and self.chance(0.15):
            phrase += " " + self.prepositional_phrase(depth + 1)
        return phrase

    def place_phrase(self) -> str:
        return f"{self.pick(PREPOSITIONS)} the {self.pick(self.topic.places)}"

    def prepositional_phrase(self, depth: int = 0) -> str:
        if self.chance(0.5):
            return self.place_phrase()
        noun_phrase = self.noun_phrase(self.noun(), singular=self.chance(0.6), depth=depth)
        return f"{self.pick(PREPOSITIONS)} {noun_phrase}"

    def subject(self, *, allow_names: bool) -> tuple[str, bool]:
        """A subject phrase and whether it is singular."""
        roll = self.rng.random()
        if allow_names and roll < 0.25:
            return self.pick(NAMES), True
        singular = self.chance(0.6)
        noun = self.pick(PEOPLE) if roll < 0.4 else self.noun()
        return self.noun_phrase(noun, singular=singular), singular

    def intransitive_clause(self, subject: str, singular: bool, past: bool) -> str:
        verb = conjugate(self.pick(self.topic.intransitive_verbs), singular=singular, past=past)
        clause = f"{subject} {verb}"
        if self.chance(0.4):
            clause += f" {self.pick(ADVERBS)}"
        if self.chance(0.6):
            clause += f" {self.prepositional_phrase()}"
        return clause

    def transitive_clause(self, subject: str, singular: bool, past: bool) -> str:
        verb = conjugate(self.pick(self.topic.transitive_verbs), singular=singular, past=past)
        obj = self.noun_phrase(self.noun(), singular=self.chance(0.6))
        clause = f"{subject} {verb} {obj}"
        if self.chance(0.3):
            clause += f" {self.pick(ADVERBS)}"
        return clause

    def copular_clause(self, subject: str, singular: bool, past: bool) -> str:
        verb = copula(singular=singular, past=past)
        first, second = self.adjective(), self.adjective()
        if first != second and self.chance(0.4):
            return f"{subject} {verb} {first} and {second}"
        return f"{subject} {verb} {self.pick(('very ', 'quite ', 'too ', '', ''))}{first}"

    def clause(self, *, past: bool, allow_names: bool = True) -> str:
        subject, singular = self.subject(allow_names=allow_names)
        rule = self.rng.choices(
            (self.intransitive_clause, self.transitive_clause, self.copular_clause),
            weights=(4, 4, 2),
        )[0]
        return rule(subject, singular, past)

    def existential_clause(self, *, past: bool) -> str:
        singular = self.chance(0.5)
        described = self.described_noun(self.noun(), singular=singular)
        if singular:
            things = with_article(described)
        else:
            things = f"{self.pick(('some', 'many', 'a few', 'two', 'three'))} {described}"
        return f"there {copula(singular=singular, past=past)} {things} {self.place_phrase()}"

    def sentence(self, *, past: bool) -> str:
        """One capitalised sentence ending in a full stop."""
        rule = self.rng.choices(
            ("simple", "compound", "subordinate", "fronted_time", "existential"),
            weights=(5, 2, 2, 2, 1),
        )[0]
        if rule == "compound":
            conjunction = self.pick(("and", "but", "so", "yet"))
            text = f"{self.clause(past=past)}, {conjunction} {self.clause(past=past)}"
        elif rule == "subordinate":
            marker = self.pick(("when", "because", "while", "although", "after", "before"))
            text = f"{marker} {self.clause(past=past)}, {self.clause(past=past)}"
        elif rule == "fronted_time":
            text = f"{self.pick(TIME_PHRASES)}, {self.clause(past=past)}"
        elif rule == "existential":
            text = self.existential_clause(past=past)
        else:
            text = self.clause(past=past)
        return capitalise(text) + "."

    # ----------------------------------------------------------------- numbers

    def count_sentence(self) -> str:
        count = self.rng.randint(2, 999)
        unit = self.pick(self.topic.units)
        templates = (
            "There are {n} {unit} {place}.",
            "The {person} counted {n} {unit} {place}.",
            "In {year}, there were {n} {unit} {place}.",
            "We saw {n} {unit} in {days} days.",
            "About {n} {unit} can be found {place}.",
        )
        return self.pick(templates).format(
            n=count,
            unit=unit,
            place=self.place_phrase(),
            person=self.pick(PEOPLE),
            year=self.rng.randint(1700, 2020),
            days=self.rng.randint(2, 30),
        )

    def arithmetic_sentence(self) -> str:
        a, b = self.rng.randint(0, 10), self.rng.randint(0, 10)
        templates = (
            f"{a} plus {b} is {a + b}.",
            f"{capitalise(NUMBER_WORDS[a])} and {NUMBER_WORDS[b]} make {NUMBER_WORDS[a + b]}.",
            f"{a + b} minus {b} is {a}.",
            f"{a} times {b} is {a * b}.",
        )
        return self.pick(templates)

    # ----------------------------------------------------------------- dialogue

    def speaker(self) -> str:
        if self.chance(0.6):
            return self.pick(NAMES)
        if self.chance(0.5):
            return f"the {self.pick(PEOPLE)}"
        return f"the {self.pick(('old', 'young', 'tired', 'curious'))} {self.pick(PEOPLE)}"

    def dialogue_exchange(self) -> list[str]:
        """A question, its answer and sometimes a reply, one quoted line each."""
        question = self.pick(self.topic.questions)
        asker, answerer = self.speaker(), self.speaker()
        if self.chance(0.3):
            answer = f"there are {self.rng.randint(2, 99)} {self.pick(self.topic.units)}"
        else:
            answer = self.clause(past=False, allow_names=False)
        lines = [
            f'"{question}?" asked {asker}.',
            f'"{capitalise(answer)}," {self.pick(SPEECH_VERBS)} {answerer}.',
        ]
        if self.chance(0.4):
            lines.append(f'"{self.pick(("Thank you", "I see", "Really", "Good"))}," said {asker}.')
        return lines


# --------------------------------------------------------------------------- documents


def essay_paragraph(grammar: Grammar) -> str:
    """Present-tense sentences about the topic, sometimes with a count."""
    sentences = [grammar.sentence(past=False) for _ in range(grammar.rng.randint(3, 7))]
    if grammar.chance(0.3):
        sentences.insert(grammar.rng.randint(0, len(sentences)), grammar.count_sentence())
    return " ".join(sentences)


def story_paragraph(grammar: Grammar) -> str:
    """A past-tense episode that opens with someone going somewhere."""
    hero = grammar.pick(NAMES)
    opening = (
        f"{capitalise(grammar.pick(TIME_PHRASES))}, {hero} went to the "
        f"{grammar.pick(grammar.topic.places)}."
    )
    sentences = [opening] + [grammar.sentence(past=True) for _ in range(grammar.rng.randint(2, 5))]
    return " ".join(sentences)


def numbers_paragraph(grammar: Grammar) -> str:
    """Counts and small sums, in a shuffled order."""
    sentences = [grammar.count_sentence() for _ in range(grammar.rng.randint(2, 4))]
    sentences += [grammar.arithmetic_sentence() for _ in range(grammar.rng.randint(1, 3))]
    grammar.rng.shuffle(sentences)
    return " ".join(sentences)


def wrap(paragraph: str) -> str:
    return textwrap.fill(paragraph, width=LINE_WIDTH, break_on_hyphens=False)


def section(rng: random.Random, index: int) -> str:
    """One titled section: essay paragraphs, a story with dialogue, maybe a numbers note."""
    topic = rng.choice(TOPICS)
    grammar = Grammar(rng, topic)
    kind = rng.choice(("On", "Notes on", "A Story of", "Thoughts on"))
    blocks = [f"{index}. {kind} {topic.title}"]
    blocks += [wrap(essay_paragraph(grammar)) for _ in range(rng.randint(1, 3))]
    story_lines = [wrap(story_paragraph(grammar))]
    for _ in range(rng.randint(0, 2)):
        story_lines += grammar.dialogue_exchange()
    blocks.append("\n".join(story_lines))
    if rng.random() < 0.35:
        blocks.append(wrap(numbers_paragraph(grammar)))
    return "\n\n".join(blocks)


def generate_corpus(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    """The full corpus text: whole sections until at least `target_bytes` ASCII bytes."""
    rng = random.Random(seed)
    sections: list[str] = []
    size = 0
    while size < target_bytes:
        text = section(rng, len(sections) + 1) + "\n\n"
        sections.append(text)
        size += len(text)
    return "".join(sections).rstrip("\n") + "\n"


def main() -> None:
    # Encoding as ASCII fails loudly rather than shipping a stray non-ASCII byte.
    data = generate_corpus().encode("ascii")
    CORPUS_PATH.parent.mkdir(parents=True, exist_ok=True)
    CORPUS_PATH.write_bytes(data)
    print(f"wrote {len(data)} bytes to {CORPUS_PATH}")


if __name__ == "__main__":
    main()
