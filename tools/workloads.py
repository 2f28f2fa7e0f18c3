"""Deterministic synthetic workloads shared by the benchmarks.

`intent` is the seed's service: a fixed ~900-token instruction (the `intent-classifier`
entry of prefixes.yaml) followed by a unique 50-100-token customer message.
"""

from __future__ import annotations

import random
from typing import Any

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


def customer_message(rng: random.Random, tokenizer: Any, low: int = 50, high: int = 100) -> str:
    """A unique customer-service message of `low`..`high` tokens (unique numbers inside)."""
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
