"""One error for every problem: checks collect all that is wrong with their
arguments (each with its exception type) and raise once, naming each.

>>> raise_problems([(ValueError, "a is 3"), (TypeError, "b is a str")], "f")
Traceback (most recent call last):
ValueError: f: 2 problems with the arguments (fix each):
  - a is 3
  - b is a str
"""

from __future__ import annotations

SEVERAL_PROBLEMS = "{where}: {count} problems with the arguments (fix each):\n"


#: One problem: the exception type to raise and its message.
Problem = tuple[type[Exception], str]


def raise_problems(problems: list[Problem], where: str) -> None:
    """Raise one error for all ``problems``: the single problem's own, or a
    ``ValueError`` listing them (a ``TypeError`` when every one is a type
    problem)."""
    if not problems:
        return
    if len(problems) == 1:
        kind, message = problems[0]
        raise kind(message)
    kind = TypeError if all(k is TypeError for k, _ in problems) else ValueError
    raise kind(SEVERAL_PROBLEMS.format(where=where, count=len(problems)) + "\n".join(f"  - {m}" for _, m in problems))
