"""Rewards for examples/own_data: fn(prompt, completion, **fields) -> float | None (fields: the row's columns)."""

from align.rewards import last_number_match


def answer_match(prompt: str, completion: str, answer: str, **fields) -> float:
    """1 if the last number in the completion is the row's answer (a random model rarely manages this)."""
    return last_number_match(prompt, completion, answer=answer)


def short(prompt: str, completion: str, **fields) -> float:
    """A shaping term any model can learn: fewer characters is better."""
    return 1.0 - min(len(completion), 40) / 40
