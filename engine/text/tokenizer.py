"""The model's tokenizer as the engine uses it: the Rust `tokenizers.Tokenizer` transformers
builds for the model, its special tokens and its chat template, without transformers.

Why: transformers' tokenizer classes are thin Python over that Rust tokenizer for everything
the engine calls (encode, decode, the vocabulary, the chat template), but importing them
costs 0.6-1.0 s of every start and every replica replacement on a 2-vCPU machine. So the
first load of a model goes through transformers (`from_transformers`: whatever its class does
to the tokenizer, such as adding a BOS post-processor, is in the Rust tokenizer it holds), the
result is stored (engine/loading/config_cache.py), and every later start reads it back.

What transformers adds in Python is repeated here exactly, and a test holds the two side by
side on real tokenizers: decoding applies `clean_up_tokenization_spaces` where transformers
would (never to byte-level BPE), `split_special_tokens` encodes special-token text as plain
text, and chat templates render through engine/text/chat_template.py. Method names and
arguments are transformers' own, so code written against either reads the same.

Thread-safe: the gateway's worker threads encode concurrently. transformers switches one
flag on its shared Rust tokenizer to split special tokens; here a second Rust tokenizer,
made the first time content holds special-token text, holds that flag, so no call changes
state another call reads (and a model's tokenizer is held twice only once that happens).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from engine.text.chat_template import default_template, render_chat_template

BACKEND_FILE = "tokenizer.json"
FACTS_FILE = "tokenizer_facts.json"

# What `clean_up_tokenization_spaces` rewrites after decoding (transformers' list).
_CLEAN_UPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


@dataclass(frozen=True)
class TokenizerFacts:
    """What transformers knows of a tokenizer beyond its Rust tokenizer.

    `special_tokens`: the named ones (`bos_token`, `eos_token`, ...), which chat templates
    read by name. `clean_up_tokenization_spaces`: whether decoding rewrites " ." to "." and
    the like, as transformers would decode (it never does for byte-level BPE)."""

    special_tokens: dict[str, str]
    all_special_ids: tuple[int, ...]
    chat_template: str | None
    clean_up_tokenization_spaces: bool
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    split_special_tokens: bool = False  # the default of `encode` (tokenizer_config.json's)


@dataclass(frozen=True, slots=True)
class EncodedText:
    """A text's token ids and where each token starts in it (`Tokenizer.encode_with_offsets`)."""

    ids: list[int]
    starts: list[int]


class Tokenizer:
    """Encode, decode, the vocabulary and the chat template of one model (module docstring).

    `chat_template` may be replaced (`--chat-template FILE`), and `template_defaults` given:
    the variables every chat prompt's rendering gets unless a request sets them
    (`--default-chat-template-kwargs`)."""

    def __init__(self, backend: RustTokenizer, facts: TokenizerFacts) -> None:
        if backend.padding is not None:
            backend.no_padding()
        if backend.truncation is not None:
            backend.no_truncation()
        backend.encode_special_tokens = False
        self._backend = backend
        self._splitting: RustTokenizer | None = None
        self._lock = threading.Lock()
        self.facts = facts
        self.chat_template: str | None = facts.chat_template
        self.template_defaults: dict[str, Any] = {}

    @classmethod
    def from_transformers(cls, tokenizer: Any) -> Tokenizer:
        """The tokenizer a transformers fast tokenizer is, as the engine uses it."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer")
        is_bpe = type(backend.model).__name__ == "BPE"
        clean_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and (
            not is_bpe
            or bool(
                getattr(
                    tokenizer,
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                    False,
                )
            )
        )
        facts = TokenizerFacts(
            special_tokens={k: str(v) for k, v in tokenizer.special_tokens_map.items()},
            all_special_ids=tuple(int(i) for i in tokenizer.all_special_ids if i is not None),
            # Named templates (a few older models hold `default` and `tool_use`): the default.
            chat_template=default_template(tokenizer.chat_template),
            clean_up_tokenization_spaces=clean_up,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            split_special_tokens=bool(getattr(tokenizer, "split_special_tokens", False)),
        )
        return cls(RustTokenizer.from_str(backend.to_str()), facts)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its parts (Ray ships the tokenizer to the ingress): a lock is not."""
        return (_unpickle, (self._backend.to_str(), self.facts, self.chat_template))

    @classmethod
    def load(cls, folder: Path) -> Tokenizer:
        """What `save` wrote; raises OSError or ValueError when it is not there or not whole."""
        facts = json.loads((folder / FACTS_FILE).read_text())
        facts["all_special_ids"] = tuple(facts["all_special_ids"])
        backend = RustTokenizer.from_file(str(folder / BACKEND_FILE))
        return cls(backend, TokenizerFacts(**facts))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / BACKEND_FILE))
        (folder / FACTS_FILE).write_text(json.dumps(asdict(self.facts)))

    # -- transformers' names ----------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> RustTokenizer:
        return self._backend

    @property
    def eos_token_id(self) -> int | None:
        return self.facts.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.facts.bos_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.facts.all_special_ids)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self.facts.special_tokens)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._backend.get_added_tokens_decoder())

    def __len__(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._backend.get_vocab(with_added_tokens=True))

    def get_added_vocab(self) -> dict[str, int]:
        decoder = self._backend.get_added_tokens_decoder()
        return {token.content: token_id for token_id, token in sorted(decoder.items())}

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool | None = None
    ) -> list[int]:
        """Token ids of `text`. `add_special_tokens`: what the tokenizer's post-processor adds
        (a BOS, for some). `split_special_tokens`: special-token text is plain text (None:
        the tokenizer's own default, as transformers has it)."""
        return list(self._encoding(text, add_special_tokens, split_special_tokens).ids)

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> EncodedText:
        """`encode`'s ids, and where each token's text starts in `text`, in characters (an
        echoed prompt's `text_offset`). A token the tokenizer added (a BOS) stands for no
        text: it starts where the text is at that point. Tokens that share a character (byte
        pieces of one) start where it does."""
        encoding = self._encoding(text, add_special_tokens, None)
        starts, at = [], 0
        for start, end in encoding.offsets:
            if end > start:
                at = start
            starts.append(at)
            at = max(at, end)
        return EncodedText(list(encoding.ids), starts)

    def _encoding(
        self, text: str, add_special_tokens: bool, split_special_tokens: bool | None
    ) -> Any:
        if split_special_tokens is None:
            split_special_tokens = self.facts.split_special_tokens
        backend = self._splitting_backend() if split_special_tokens else self._backend
        # encode_batch, as transformers calls it: unlike `encode`, it lets go of the GIL, so a
        # 2 MB prompt tokenized in a worker thread does not stall the event loop.
        [encoding] = backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding

    def _splitting_backend(self) -> RustTokenizer:
        with self._lock:
            if self._splitting is None:
                splitting = RustTokenizer.from_str(self._backend.to_str())
                splitting.encode_special_tokens = True
                self._splitting = splitting
            return self._splitting

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """`clean_up_tokenization_spaces`: None for the tokenizer's own setting."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))
        clean_up = clean_up_tokenization_spaces
        if clean_up is None:
            clean_up = self.facts.clean_up_tokenization_spaces
        if clean_up:
            for before, after in _CLEAN_UPS:
                text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        """A token's vocabulary string (None for an id it does not have); a list for a list."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **variables: Any,
    ) -> str:
        """The conversation as the chat template writes it (text: tokenize it with
        `encode(..., add_special_tokens=False)`); `variables`: more of the template's own, as
        transformers' method takes them. Raises ValueError without a template and
        jinja2.TemplateError when the template refuses the conversation."""
        if tokenize:
            raise ValueError("render first, then encode: the engine tokenizes separately")
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return render_chat_template(
            self.chat_template,
            conversation,
            tools,
            add_generation_prompt,
            self.facts.special_tokens,
            variables,
        )


def _unpickle(backend: str, facts: TokenizerFacts, chat_template: str | None) -> Tokenizer:
    tokenizer = Tokenizer(RustTokenizer.from_str(backend), facts)
    tokenizer.chat_template = chat_template
    return tokenizer
