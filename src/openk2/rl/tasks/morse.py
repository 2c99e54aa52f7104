"""Morse-code decoding: turn International Morse (letters split by spaces, words by ' / ') into text.

`data` is `{"morse": str, "text": str}`. The answer is compared with the plaintext ignoring case and runs
of whitespace. Difficulty = number of words, with digits mixed in from level 4.
"""

from __future__ import annotations

import random

from openk2.rl.tasks.base import Problem, Task, extract_answer

MORSE = {
    "A": ".-", "B": "-...", "C": "-.-.", "D": "-..", "E": ".", "F": "..-.", "G": "--.", "H": "....", "I": "..",
    "J": ".---", "K": "-.-", "L": ".-..", "M": "--", "N": "-.", "O": "---", "P": ".--.", "Q": "--.-", "R": ".-.",
    "S": "...", "T": "-", "U": "..-", "V": "...-", "W": ".--", "X": "-..-", "Y": "-.--", "Z": "--..",
    "0": "-----", "1": ".----", "2": "..---", "3": "...--", "4": "....-", "5": ".....", "6": "-....",
    "7": "--...", "8": "---..", "9": "----.",
}
_DECODE = {code: char for char, code in MORSE.items()}
_WORDS = ("the quick brown fox jumps over lazy dog river stone light night green house water paper music "
          "table window garden winter summer bread apple train cloud storm silver orange planet rocket "
          "signal ocean forest valley mountain bridge castle dragon pencil market yellow purple engine "
          "wizard puzzle secret morning evening kitchen letter number").split()
_LEVELS = {1: (1, False), 2: (2, False), 3: (3, False), 4: (4, True), 5: (6, True)}  # words, digits


class MorseTask(Task):
    name = "morse"
    num_difficulties = len(_LEVELS)
    max_tokens = 1024

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        num_words, with_digits = _LEVELS[difficulty]
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        words = [rng.choice(_WORDS) for _ in range(num_words)]
        if with_digits:
            words[rng.randrange(num_words)] = str(rng.randint(0, 9999))
        text = " ".join(words).upper()
        morse = encode_morse(text)
        prompt = f"Decode this Morse code (letters are separated by spaces, words by ' / '):\n{morse}"
        return self._problem(prompt, {"morse": morse, "text": text}, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        answer = extract_answer(response_text)
        return float(answer is not None and _normalise(answer) == _normalise(problem.data["text"]))


def encode_morse(text: str) -> str:
    """`text` (letters, digits, spaces) in Morse; raises ValueError on other characters."""
    try:
        return " / ".join(" ".join(MORSE[c] for c in word) for word in text.upper().split())
    except KeyError as e:
        raise ValueError(f"no Morse code for {e.args[0]!r}") from e


def decode_morse(morse: str) -> str:
    """The text of `morse`; unknown codes decode to '?'."""
    return " ".join("".join(_DECODE.get(code, "?") for code in word.split()) for word in morse.split("/"))


def _normalise(text: str) -> str:
    return " ".join(text.upper().strip().strip("\"'.").split())
