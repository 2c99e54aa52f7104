"""Byte-level BPE tokenizer with Kimi K2's special tokens, trained locally or loaded from tiktoken ranks."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

# K2's pre-tokenisation regex (tiktoken `pat_str` of the released tokenizer): Han runs, cased words with
# English contractions, digits in groups of at most three, punctuation runs, newlines, other whitespace.
# Both tiktoken (Rust regex) and HF tokenizers (Oniguruma) accept the `&&` class intersections.
K2_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Released K2: 163584 BPE tokens, then a block of 256 special slots. Offsets inside the block:
K2_NUM_BASE_TOKENS = 163584
K2_NUM_SPECIAL_SLOTS = 256
K2_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
}
# [UNK] and [PAD] are always the last two ids of the vocabulary (163838, 163839 in K2).
K2_TAIL_TOKENS = ("[UNK]", "[PAD]")
K2_SPECIAL_TOKENS: tuple[str, ...] = (*K2_SPECIAL_OFFSETS, *K2_TAIL_TOKENS)
MIN_SPECIAL_SLOTS = max(K2_SPECIAL_OFFSETS.values()) + 1 + len(K2_TAIL_TOKENS)
NUM_BYTES = 256

TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"


def reserved_token_name(token_id: int) -> str:
    """K2's name for an unused special slot (named by its absolute id)."""
    return f"<|reserved_token_{token_id}|>"


def special_block(num_base_tokens: int, num_slots: int) -> list[str]:
    """Names of the special slots placed after `num_base_tokens` BPE tokens, in id order (K2 layout)."""
    if num_slots < MIN_SPECIAL_SLOTS:
        raise ValueError(f"need at least {MIN_SPECIAL_SLOTS} special slots for K2's tokens, got {num_slots}")
    names = [reserved_token_name(num_base_tokens + i) for i in range(num_slots)]
    for name, offset in K2_SPECIAL_OFFSETS.items():
        names[offset] = name
    names[-2], names[-1] = K2_TAIL_TOKENS
    return names


class _Backend(Protocol):
    """What K2Tokenizer needs from an encoding engine."""

    def encode(self, text: str, allow_special: bool) -> list[int]: ...

    def encode_batch(self, texts: list[str], allow_special: bool) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def fingerprint(self) -> str: ...

    def save(self, directory: Path) -> None: ...


class _HFBackend:
    """HF `tokenizers` engine; a second copy with specials disabled encodes untrusted text."""

    def __init__(self, tok: HFTokenizer) -> None:
        self.tok = tok
        self.plain = HFTokenizer.from_str(tok.to_str())
        # Special-token strings in ordinary text are then split like any other text.
        self.plain.encode_special_tokens = True

    def encode(self, text: str, allow_special: bool) -> list[int]:
        tok = self.tok if allow_special else self.plain
        return tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], allow_special: bool) -> list[list[int]]:
        tok = self.tok if allow_special else self.plain
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()

    def save(self, directory: Path) -> None:
        self.tok.save(str(directory / TOKENIZER_FILE))


class _TiktokenBackend:
    """tiktoken engine over a K2-style `tiktoken.model` ranks table."""

    def __init__(self, ranks: dict[bytes, int], special: dict[str, int], pat_str: str) -> None:
        try:
            import tiktoken
        except ImportError as err:
            raise ImportError(
                "loading a tiktoken.model file needs the optional 'tiktoken' package: pip install tiktoken"
            ) from err
        self.ranks, self.special, self.pat_str = ranks, special, pat_str
        self.enc = tiktoken.Encoding(
            "openk2-tiktoken", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special
        )

    def encode(self, text: str, allow_special: bool) -> list[int]:
        if allow_special:
            return self.enc.encode(text, allowed_special="all")
        return self.enc.encode(text, allowed_special=set(), disallowed_special=())

    def encode_batch(self, texts: list[str], allow_special: bool) -> list[list[int]]:
        if allow_special:
            return self.enc.encode_batch(texts, allowed_special="all")
        return self.enc.encode_batch(texts, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(list(ids))

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.pat_str.encode())
        h.update(json.dumps(self.special, sort_keys=True).encode())
        for token, rank in sorted(self.ranks.items(), key=lambda kv: kv[1]):
            h.update(b"%d:%s\n" % (rank, base64.b64encode(token)))
        return h.hexdigest()

    def save(self, directory: Path) -> None:
        lines = [
            f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(self.ranks.items(), key=lambda x: x[1])
        ]
        (directory / TIKTOKEN_FILE).write_text("".join(lines))


class K2Tokenizer:
    """Tokenizer wrapper exposing K2's special tokens by name and id."""

    def __init__(self, backend: _Backend, special_ids: Mapping[str, int], vocab_size: int) -> None:
        missing = [name for name in K2_SPECIAL_TOKENS if name not in special_ids]
        if missing:
            raise ValueError(f"tokenizer lacks K2 special tokens: {missing}")
        self._backend = backend
        self.special_ids: dict[str, int] = dict(special_ids)
        self.vocab_size = vocab_size
        self.bos_id = self.special_ids["[BOS]"]
        self.eos_id = self.special_ids["[EOS]"]
        self.pad_id = self.special_ids["[PAD]"]
        self.unk_id = self.special_ids["[UNK]"]
        self._fingerprint: str | None = None

    @property
    def num_base_tokens(self) -> int:
        """Number of ordinary (BPE) tokens; the special block starts at this id."""
        return self.bos_id

    @property
    def fingerprint(self) -> str:
        """Stable hash of the vocabulary and rules, used to key token caches."""
        if self._fingerprint is None:
            self._fingerprint = self._backend.fingerprint()
        return self._fingerprint

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings map to their ids only when `allow_special`."""
        return self._backend.encode(text, allow_special)

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """Encode many texts at once (parallel in the backend)."""
        return self._backend.encode_batch(list(texts), allow_special)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens decode to their names."""
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return self._backend.decode(ids)

    def config(self) -> dict:
        """The contents of tokenizer_config.json."""
        named = {name: self.special_ids[name] for name in K2_SPECIAL_TOKENS}
        return {
            "tokenizer_class": "openk2.K2Tokenizer",
            "vocab_size": self.vocab_size,
            "num_base_tokens": self.num_base_tokens,
            "special_tokens": named,
            "bos_token": "[BOS]",
            "eos_token": "[EOS]",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "unk_token_id": self.unk_id,
            "chat_token_ids": {k: v for k, v in named.items() if k.startswith("<|")},
        }

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json (or tiktoken.model) and tokenizer_config.json into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(directory)
        cfg = self.config()
        if isinstance(self._backend, _TiktokenBackend):
            # tiktoken files carry no specials, so keep every slot (reserved ones too) and the regex.
            cfg["added_tokens"] = self._backend.special
            cfg["pat_str"] = self._backend.pat_str
        (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, path: str | Path) -> K2Tokenizer:
        """Load from a directory written by `save`, a tokenizer.json, or a tiktoken.model file."""
        path = Path(path)
        if path.is_dir():
            if (path / TOKENIZER_FILE).exists():
                path = path / TOKENIZER_FILE
            elif (path / TIKTOKEN_FILE).exists():
                path = path / TIKTOKEN_FILE
            else:
                raise ValueError(f"{path} has neither {TOKENIZER_FILE} nor {TIKTOKEN_FILE}")
        if not path.exists():
            raise ValueError(f"no tokenizer at {path}")
        if path.suffix == ".json":
            return cls.from_hf(HFTokenizer.from_file(str(path)))
        cfg_path = path.parent / CONFIG_FILE
        special, pat = None, K2_PAT_STR
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
            special, pat = cfg.get("added_tokens"), cfg.get("pat_str", K2_PAT_STR)
        return cls.from_tiktoken(path, special_tokens=special, pat_str=pat)

    @classmethod
    def from_hf(cls, tok: HFTokenizer) -> K2Tokenizer:
        """Wrap a HF `tokenizers.Tokenizer` that contains K2's special tokens."""
        ids = {name: tok.token_to_id(name) for name in K2_SPECIAL_TOKENS}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks K2 special tokens: {missing}")
        return cls(_HFBackend(tok), ids, tok.get_vocab_size())

    @classmethod
    def from_tiktoken(
        cls, path: str | Path, special_tokens: Mapping[str, int] | None = None, pat_str: str = K2_PAT_STR
    ) -> K2Tokenizer:
        """Load a K2 `tiktoken.model` ranks file (`base64(token) rank` per line); needs `tiktoken`.

        Without `special_tokens`, K2's layout is assumed: 256 special slots right after the ranks.
        """
        ranks = read_tiktoken_ranks(path)
        if special_tokens is None:
            names = special_block(len(ranks), K2_NUM_SPECIAL_SLOTS)
            special_tokens = {name: len(ranks) + i for i, name in enumerate(names)}
        special = dict(special_tokens)
        clash = sorted(set(special.values()) & set(ranks.values()))
        if clash:
            raise ValueError(f"special token ids collide with BPE ranks: {clash[:5]}")
        vocab_size = max([*ranks.values(), *special.values()]) + 1
        return cls(_TiktokenBackend(ranks, special, pat_str), special, vocab_size)


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one `base64(token_bytes) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (IndexError, ValueError) as err:
            raise ValueError(f"{path}:{lineno}: expected 'base64_token rank', got {line[:60]!r}") from err
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path} holds no ranks")
    return ranks


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, num_special: int = K2_NUM_SPECIAL_SLOTS
) -> K2Tokenizer:
    """Train a byte-level BPE on `texts`: `vocab_size` ids in all, the last `num_special` being K2's block.

    If the texts are too small for that many merges, the special block grows (more reserved slots) so the
    vocabulary still has exactly `vocab_size` ids.
    """
    if num_special < MIN_SPECIAL_SLOTS:
        raise ValueError(f"num_special must be at least {MIN_SPECIAL_SLOTS}, got {num_special}")
    if vocab_size < NUM_BYTES + num_special:
        raise ValueError(
            f"vocab_size must be at least {NUM_BYTES + num_special} (256 bytes + {num_special} specials),"
            f" got {vocab_size}"
        )
    tok = HFTokenizer(models.BPE())
    # K2's regex splits words; ByteLevel (without its own regex) maps bytes to printable symbols.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(K2_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    num_base = tok.get_vocab_size()
    names = special_block(num_base, vocab_size - num_base)
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"built {tok.get_vocab_size()} ids instead of {vocab_size}")
    return K2Tokenizer.from_hf(tok)
