"""A small synthetic language, generated deterministically: the default corpus of ``blazecore train``.

Nothing is downloaded or shipped as data: a fixed seed drives a word-level generator with a grammar
(determiners, adjectives, number agreement between subject and verb, prepositional phrases, clauses
embedded with "that"), a fixed world (every person lives in one town and likes one food: facts a model
can memorise), counting runs ("count : four five six .") and copies ("... says : w1 w2 w3 ; ...
repeats : w1 w2 w3 ."), which need attention to earlier tokens. A language model starts at ln(V)
(about 5.2 nats for the ~180 words) and has a lot of structure to learn below that.

    lang = SyntheticLanguage()
    ids = lang.generate(100_000)          # (100000,) int32, the same on every machine for a given seed
    print(lang.decode(ids[:40]))

Generation uses only Python's ``random.Random`` (Mersenne Twister, stable across Python versions) and
is prefix-stable: ``generate(n)`` is the first n tokens of ``generate(m)`` for m > n.
"""

from __future__ import annotations

import random

import numpy as np

__all__ = ["SyntheticLanguage"]

EOS = "<eos>"

_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar",
          "peggy", "trent", "victor", "wendy")
_TOWNS = ("paris", "oslo", "lima", "cairo", "delhi", "quito", "rome", "tokyo")
_FOODS = ("apples", "bread", "cheese", "rice", "soup", "plums", "honey", "beans")
# (singular, plural)
_NOUNS = (("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"), ("child", "children"),
          ("teacher", "teachers"), ("farmer", "farmers"), ("king", "kings"), ("queen", "queens"),
          ("robot", "robots"), ("sailor", "sailors"), ("painter", "painters"))
_THINGS = (("ball", "balls"), ("book", "books"), ("stone", "stones"), ("boat", "boats"), ("song", "songs"),
           ("letter", "letters"), ("house", "houses"), ("tree", "trees"), ("river", "rivers"), ("lamp", "lamps"))
_ADJECTIVES = ("red", "green", "blue", "small", "big", "old", "young", "quiet", "happy", "strange", "bright", "dark")
# (third person singular, base form)
_TRANSITIVE = (("sees", "see"), ("likes", "like"), ("finds", "find"), ("carries", "carry"), ("follows", "follow"),
               ("builds", "build"), ("reads", "read"), ("paints", "paint"), ("helps", "help"), ("keeps", "keep"))
_INTRANSITIVE = (("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"), ("laughs", "laugh"),
                 ("swims", "swim"))
_SAYING = (("says", "say"), ("thinks", "think"), ("knows", "know"))
_ADVERBS = ("quickly", "slowly", "quietly", "often", "never", "today")
_PREPOSITIONS = ("near", "under", "behind", "with", "over")
_DET_SINGULAR = ("the", "a", "every", "this", "that")
_DET_PLURAL = ("the", "some", "these", "those", "many", "few")
_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
            "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
_FUNCTION = ("lives", "in", "eat", "eats", "to", "does", "do", "count", "repeats", "that", "and", "but", "because",
             ":", ";", ",", ".", "?")


def _vocabulary() -> tuple:
    words = [EOS]
    groups = (_NAMES, _TOWNS, _FOODS, _ADJECTIVES, _ADVERBS, _PREPOSITIONS, _DET_SINGULAR, _DET_PLURAL, _NUMBERS,
              _FUNCTION)
    pairs = (_NOUNS, _THINGS, _TRANSITIVE, _INTRANSITIVE, _SAYING)
    for group in groups:
        words.extend(group)
    for group in pairs:
        for a, b in group:
            words.extend((a, b))
    seen, out = set(), []
    for w in words:
        if w not in seen:
            seen.add(w)
            out.append(w)
    return tuple(out)


class SyntheticLanguage:
    """The generator and its word-level tokenizer.

    Args:
        seed: picks the world (who lives where, who likes what) and the text; the default 0 is the corpus
            ``blazecore train`` uses.

    Attributes:
        vocab: tuple of words; token id i is ``vocab[i]``. ``vocab[0]`` is the document separator ``<eos>``.
    """

    VERSION = 1

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self.vocab = _vocabulary()
        self.index = {w: i for i, w in enumerate(self.vocab)}
        world = random.Random(f"world-{self.seed}")
        self.home = {n: world.choice(_TOWNS) for n in _NAMES}
        self.food = {n: world.choice(_FOODS) for n in _NAMES}

    def __repr__(self) -> str:
        return f"SyntheticLanguage(seed={self.seed}, version={self.VERSION}, vocab={len(self.vocab)})"

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def describe(self) -> dict:
        return {"name": "synthetic", "version": self.VERSION, "seed": self.seed, "vocab_size": self.vocab_size}

    # -- grammar --------------------------------------------------------------------------------

    def _noun_phrase(self, r: random.Random, plural: bool, things: bool = False, depth: int = 0) -> list:
        nouns = _THINGS if things else _NOUNS
        words = [r.choice(_DET_PLURAL if plural else _DET_SINGULAR)]
        if r.random() < 0.5:
            words.append(r.choice(_ADJECTIVES))
            if r.random() < 0.2:
                words.append(r.choice(_ADJECTIVES))
        words.append(r.choice(nouns)[1 if plural else 0])
        if depth == 0 and r.random() < 0.25:
            words += [r.choice(_PREPOSITIONS), *self._noun_phrase(r, r.random() < 0.4, True, depth + 1)]
        return words

    def _subject(self, r: random.Random) -> tuple:
        """(words, plural)."""
        if r.random() < 0.3:
            return [r.choice(_NAMES)], False
        plural = r.random() < 0.45
        return self._noun_phrase(r, plural), plural

    def _clause(self, r: random.Random, depth: int = 0) -> list:
        subject, plural = self._subject(r)
        form = 1 if plural else 0
        u = r.random()
        if u < 0.5:
            verb = r.choice(_TRANSITIVE)[form]
            obj = self._noun_phrase(r, r.random() < 0.4, things=r.random() < 0.6)
            words = [*subject, verb, *obj]
        elif u < 0.75 or depth > 0:
            words = [*subject, r.choice(_INTRANSITIVE)[form]]
            if r.random() < 0.5:
                words.append(r.choice(_ADVERBS))
        else:
            words = [*subject, r.choice(_SAYING)[form], "that", *self._clause(r, depth + 1)]
        return words

    def _sentence(self, r: random.Random) -> list:
        u = r.random()
        if u < 0.45:
            words = self._clause(r)
            if r.random() < 0.2:
                words += [r.choice((",", "and", "but", "because")), *self._clause(r, 1)]
            return [*words, "."]
        if u < 0.6:  # a fact of the fixed world
            name = r.choice(_NAMES)
            if r.random() < 0.5:
                return [name, "lives", "in", self.home[name], "."]
            return [name, "eats", self.food[name], "."]
        if u < 0.72:  # counting: consecutive numbers
            start = r.randrange(0, 15)
            stop = min(len(_NUMBERS) - 1, start + r.randrange(2, 7))
            return ["count", ":", *_NUMBERS[start : stop + 1], "."]
        if u < 0.86:  # copying: the second half repeats the first
            a, b = r.sample(_NAMES, 2)
            n = r.randrange(2, 6)
            pool = _ADJECTIVES + _FOODS + _TOWNS + tuple(t[0] for t in _THINGS)
            said = [r.choice(pool) for _ in range(n)]
            return [a, "says", ":", *said, ";", b, "repeats", ":", *said, "."]
        subject, plural = self._subject(r)  # a question: "does"/"do" + subject + base form
        verb = r.choice(_TRANSITIVE)[1]
        return ["do" if plural else "does", *subject, verb, *self._noun_phrase(r, r.random() < 0.4, True), "?"]

    # -- text -----------------------------------------------------------------------------------

    def words(self, n_tokens: int) -> list:
        """The first ``n_tokens`` words of the corpus."""
        r = random.Random(f"text-{self.seed}")
        out: list = []
        while len(out) < n_tokens:
            for _ in range(r.randrange(3, 10)):
                out.extend(self._sentence(r))
            out.append(EOS)
        return out[:n_tokens]

    def generate(self, n_tokens: int) -> np.ndarray:
        """The first ``n_tokens`` token ids of the corpus, (n_tokens,) int32."""
        index = self.index
        return np.fromiter((index[w] for w in self.words(n_tokens)), dtype=np.int32, count=n_tokens)

    def decode(self, ids) -> str:
        """Token ids (any int sequence) as text; ``<eos>`` becomes a line break."""
        words = [self.vocab[int(i)] for i in ids]
        return " ".join(words).replace(f" {EOS} ", "\n").replace(EOS, "\n")
