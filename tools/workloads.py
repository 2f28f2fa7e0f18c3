"""Deterministic synthetic workloads shared by the benchmarks.

`intent` is the seed's service: a fixed ~900-token instruction (the `intent-classifier`
entry of prefixes.yaml) followed by a unique 50-100-token customer message.

The serving benchmark (tools/bench_serving.py) builds four workloads with `build_workload`,
all deterministic for a given seed and stream:
  intent           system = the intent-classifier instruction, user = a unique customer message;
  unique           the same requests with a random nonce at the very start of the system prompt,
                   so no server can reuse any prefix beyond the chat template's first tokens
                   (the honest caching-off baseline);
  chat-multi-turn  conversations growing turn by turn: each request is the conversation so far
                   (fixed canned assistant replies) plus a new user turn, sent after the
                   previous turn of the same conversation has finished;
  decode-heavy     ~20-token prompts with no system prompt, meant for long outputs;
  copy             a registered policy (the support-assistant entry: its rules and worked
                   examples) followed by a request to quote, extract or rewrite part of it,
                   so that the answer copies runs of the prompt (extraction, quoting, rewriting;
                   long outputs, where prompt-lookup drafts are accepted).

Message lengths are measured in tokens by a `tokenizer` with `encode(text) -> list`. Without
one, `ApproxTokenizer` stands in so that no model has to be loaded: it counts one token per
alphabetic word, digit, and punctuation mark. On these messages that is 0.95x the
SmolLM2 tokenizer's count (0.88-1.0 over 300 messages), closer than the rule of thumb of
0.75 words per token (0.76 on average here, but 0.61-0.90 from message to message).
`customer_message` stops before a sentence would pass its target, so its "50-100-token"
messages are ~35-100 tokens, ~65-70 on average.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

WORKLOADS = ("intent", "chat-multi-turn", "decode-heavy", "unique", "copy")
DEFAULT_MAX_TOKENS = {
    "intent": 30,
    "chat-multi-turn": 64,
    "decode-heavy": 128,
    "unique": 30,
    "copy": 160,
}

_OPENERS = [
    "Hi there,",
    "Hello,",
    "Good morning,",
    "Hey support team,",
    "Dear Acme team,",
    "Quick question:",
    "Hi, hoping you can help.",
    "Hello again,",
]
_SUBJECTS = [
    "my order {n} still has not arrived and the tracking page has not changed for {d} days",
    "I was charged twice for invoice {n} on my card ending in {d}",
    "I cannot log in to my account since the password reset email never came",
    "the app crashes every time I open the photos folder on my phone",
    "I would like to cancel my subscription before the next renewal on the {d}th",
    "the package {n} arrived damaged and the box was open",
    "I want to upgrade my plan to the family tier with {d} extra seats",
    "how do I export all my files before I close the account",
    "your courier left the parcel {n} at the wrong address",
    "the discount code SPRING{d} did not apply at checkout",
    "I need a copy of my invoice {n} for my company's accounting",
    "can I change the delivery date for order {n} to next week",
]
_DETAILS = [
    "I already tried restarting the device and clearing the cache.",
    "This is the third time I am writing about it.",
    "My account email is the one I used to sign up {d} years ago.",
    "I am travelling next week so I would appreciate a quick answer.",
    "The reference number on my receipt is {n}.",
    "Please let me know what information you need from me.",
    "I have attached a screenshot of the error message.",
    "Honestly I am quite frustrated at this point.",
    "My neighbour had the same problem last month.",
    "I have been a customer for a long time and never had issues before.",
]
_CLOSERS = ["Thanks!", "Thank you in advance.", "Regards, Sam", "Best, Alex", "Cheers."]


def customer_message(
    rng: random.Random, tokenizer: Any | None, low: int = 50, high: int = 100
) -> str:
    """A unique customer-service message of `low`..`high` tokens (unique numbers inside).

    `tokenizer=None` measures tokens with `ApproxTokenizer`."""
    tokenizer = tokenizer or ApproxTokenizer()
    target = rng.randint(low, high)
    parts = [rng.choice(_OPENERS)]
    while True:
        template = rng.choice(_SUBJECTS + _DETAILS)
        sentence = template.format(n=rng.randint(10_000, 99_999), d=rng.randint(2, 28))
        candidate = " ".join([*parts, sentence[0].upper() + sentence[1:] + "."])
        if len(tokenizer.encode(candidate)) > target - 4:
            break
        parts.append(sentence[0].upper() + sentence[1:] + ".")
    parts.append(rng.choice(_CLOSERS))
    return " ".join(parts).replace("..", ".")


def intent_messages(system_prompt: str, tokenizer: Any, num: int, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    return [
        [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": customer_message(rng, tokenizer)},
        ]
        for _ in range(num)
    ]


class ApproxTokenizer:
    """Token counts without a model: one token per alphabetic word, digit, or punctuation mark."""

    _PIECE = re.compile(r"[A-Za-z]+|\d|[^\w\s]")

    def encode(self, text: str) -> list[str]:
        return self._PIECE.findall(text)


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One chat request of a workload. `depends_on` is the index (in the workload's list) of
    the request that must finish before this one is sent: the previous turn of the same
    conversation, or None."""

    messages: list[dict[str, str]]
    conversation: int
    turn: int
    depends_on: int | None = None


def build_workload(
    name: str,
    num: int,
    seed: int,
    system_messages: list[dict[str, str]],
    tokenizer: Any | None = None,
    num_turns: int = 4,
    stream: int | str = 0,
) -> list[WorkloadRequest]:
    """`num` requests of workload `name`. `system_messages` is the prefix the workload starts
    from (a prefixes.yaml entry's messages; decode-heavy ignores it). The same
    (seed, stream) always gives the same requests; different streams give fresh messages
    (so that a sweep's steps, or warmup, never resend a prompt a server may have cached)."""
    rng = random.Random(seed if stream == 0 else f"{seed}/{stream}")
    if name in ("intent", "unique"):
        system = _system_content(system_messages)
        requests = [
            WorkloadRequest(_intent(system, customer_message(rng, tokenizer)), i, 0)
            for i in range(num)
        ]
        return _with_nonces(requests, rng) if name == "unique" else requests
    if name == "chat-multi-turn":
        return _multi_turn(rng, num, num_turns, system_messages, tokenizer)
    if name == "decode-heavy":
        return [WorkloadRequest([_user(_story_prompt(rng))], i, 0) for i in range(num)]
    if name == "copy":
        return [
            WorkloadRequest([*system_messages, _user(_copy_request(rng))], i, 0) for i in range(num)
        ]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


_COPY_ASKS = [
    "Quote, word for word, every rule of yours that mentions {topic}.",
    "Copy the part of your instructions about {topic} exactly as written, then say which "
    "menu it names.",
    "Repeat your instructions about {topic} verbatim, as a bulleted list.",
    "What exactly do your rules say about {topic}? Quote them, do not paraphrase.",
    "Rewrite your rules about {topic} as short numbered steps, keeping their wording.",
    "Extract the sentences of your instructions that mention {topic} and list them in order.",
]
_COPY_TOPICS = [
    "Trash and deleted files",
    "refunds",
    "passwords and suspicious logins",
    "how to answer (tone and length)",
    "what you cannot see or change",
    "unknown answers and human agents",
    "other topics",
    "file versions",
]


def _copy_request(rng: random.Random) -> str:
    # A reference number makes every request's prompt its own (no answer can be served
    # from an identical earlier prompt), as a customer's ticket would.
    ask = rng.choice(_COPY_ASKS).format(topic=rng.choice(_COPY_TOPICS))
    return f"{ask} (ticket {rng.randrange(10**5, 10**6)})"


def _system_content(system_messages: list[dict[str, str]]) -> str:
    for message in system_messages:
        if message["role"] == "system":
            return message["content"]
    raise ValueError("the prefix has no system message")


def _intent(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, _user(user)]


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _with_nonces(requests: list[WorkloadRequest], rng: random.Random) -> list[WorkloadRequest]:
    # The nonce comes first so that even the system prompt's first block differs: the user
    # messages equal the `intent` workload's (same seed and stream), only the prefix changes.
    out = []
    for r in requests:
        system, user = r.messages
        content = f"{rng.getrandbits(64):016x} (request id; ignore it)\n{system['content']}"
        out.append(WorkloadRequest(_intent(content, user["content"]), r.conversation, r.turn))
    return out


_FOLLOW_UPS = [
    "Thanks. And what about order {n}, is that one affected too?",
    "I tried that but it still does not work. What should I do next?",
    "Can you also tell me when invoice {n} will be sent?",
    "OK. How long does that usually take?",
    "My colleague with account {n} has the same problem, can you check it as well?",
    "Is there a way to do this from the phone app instead?",
    "Will I lose any files if I do that?",
    "Great, one last thing: how do I turn off the weekly emails?",
]
_CANNED_REPLIES = [
    "I'm sorry about the trouble. Please open Settings > Account and check that your plan and "
    "email are correct; if they are, sign out and back in, then try again. If it still fails, "
    "I can connect you with a human agent.",
    "Thanks for the details. This usually resolves within one business day. You can follow the "
    "status under Settings > Account > Requests, and you will get an email as soon as it is done.",
    "Good question. Nothing is deleted by this: your files stay in place, and anything removed "
    "by mistake stays in Trash for 30 days, so you can restore it from there.",
    "Yes, the same steps work in the phone app: tap your profile picture, then Settings, then "
    "Account. The options have the same names as on the web.",
]


def _multi_turn(
    rng: random.Random,
    num: int,
    num_turns: int,
    prefix: list[dict[str, str]],
    tokenizer: Any | None,
) -> list[WorkloadRequest]:
    """ceil(num / num_turns) conversations, listed turn by turn (turn 0 of every conversation,
    then turn 1, ...) so that consecutive requests belong to different conversations."""
    if num_turns < 1:
        raise ValueError("num_turns must be >= 1")
    num_conversations = -(-num // num_turns)
    history: list[list[list[dict[str, str]]]] = []
    for conversation in range(num_conversations):
        turns, messages = [], [dict(m) for m in prefix]
        for turn in range(num_turns):
            if turn == 0:
                text = customer_message(rng, tokenizer, 20, 50)
            else:
                text = rng.choice(_FOLLOW_UPS).format(n=rng.randint(10_000, 99_999))
                reply = _CANNED_REPLIES[(conversation + turn - 1) % len(_CANNED_REPLIES)]
                messages = [*messages, {"role": "assistant", "content": reply}]
            messages = [*messages, _user(text)]
            turns.append(messages)
        history.append(turns)
    requests: list[WorkloadRequest] = []
    index_of: dict[tuple[int, int], int] = {}
    for turn in range(num_turns):
        for conversation in range(num_conversations):
            if len(requests) == num:
                return requests
            index_of[conversation, turn] = len(requests)
            previous = index_of.get((conversation, turn - 1))
            messages = history[conversation][turn]
            requests.append(WorkloadRequest(messages, conversation, turn, previous))
    return requests


_STORY_SUBJECTS = [
    "a lighthouse keeper",
    "a robot gardener",
    "two rival bakers",
    "a lost cat in a big city",
    "an old sailing ship",
    "a child who can talk to birds",
    "a librarian on the moon",
    "a very slow detective",
]


def _story_prompt(rng: random.Random) -> str:
    subject = rng.choice(_STORY_SUBJECTS)
    return f"Write a long and detailed story about {subject}. Story number {rng.randint(1, 9999)}."
