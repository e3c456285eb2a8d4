"""Long-Range-Arena ListOps (Nangia & Bowman, 2018; Tay et al., LRA, 2021), generated here.

Grammar: an expression is a digit ``0``..``9`` or ``[OP e_1 ... e_m ]`` with ``m`` in
[2, ``max_args``] sub-expressions and OP one of

- ``MAX`` / ``MIN``: the largest / smallest argument,
- ``MED``: the median, rounded down (``int(median)``),
- ``SM``: the sum modulo 10.

The label is the value of the expression (10 classes). Trees are drawn as in the LRA generator: at
depth < ``max_depth`` a node is an operator with probability ``op_prob`` (LRA: 0.25), otherwise a
digit; an operator draws its number of arguments uniformly in [2, max_args] and OP uniformly. The
whole expression is kept only when its token count (operator and ``]`` are one token each, as in
LRA after removing the parentheses) lies in [``min_length``, ``max_length``] (rejection sampling).
LRA uses max_depth 10, max_args 10 and lengths 500..2000; the defaults here are shorter.

Tokens: ``<pad>`` = 0, the digits, ``[MAX``, ``[MIN``, ``[MED``, ``[SM``, ``]``; sequences are
right-padded to ``max_length``.
"""
from __future__ import annotations

import random
from typing import List, Optional, Tuple

import torch

from .base import SequenceDataset
from .registry import check_split, register_dataset

__all__ = ["VOCAB", "OPS", "generate_expression", "evaluate", "tokenize", "listops"]

OPS = ("MAX", "MIN", "MED", "SM")
VOCAB: List[str] = ["<pad>"] + [str(d) for d in range(10)] + [f"[{op}" for op in OPS] + ["]"]
_STOI = {t: i for i, t in enumerate(VOCAB)}


def _apply(op: str, args: List[int]) -> int:
    if op == "MAX":
        return max(args)
    if op == "MIN":
        return min(args)
    if op == "SM":
        return sum(args) % 10
    s = sorted(args)  # MED
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2


class _TooLong(Exception):
    pass


def _grow(rng: random.Random, depth: int, max_depth: int, max_args: int, op_prob: float, out: List[str],
          budget: int) -> int:
    """Append one expression's tokens to ``out`` and return its value; raise when past budget."""
    if depth < max_depth and rng.random() < op_prob:
        op = rng.choice(OPS)
        n = rng.randint(2, max_args)
        out.append(f"[{op}")
        vals = [_grow(rng, depth + 1, max_depth, max_args, op_prob, out, budget) for _ in range(n)]
        out.append("]")
        if len(out) > budget:
            raise _TooLong
        return _apply(op, vals)
    out.append(str(rng.randrange(10)))
    if len(out) > budget:
        raise _TooLong
    return int(out[-1])


def generate_expression(rng: random.Random, min_length: int = 32, max_length: int = 256, max_depth: int = 10,
                        max_args: int = 10, op_prob: float = 0.25, max_tries: int = 100_000
                        ) -> Tuple[List[str], int]:
    """One ListOps expression (token list) with its value, length in [min_length, max_length]."""
    for _ in range(max_tries):
        out: List[str] = []
        try:
            value = _grow(rng, 1, max_depth, max_args, op_prob, out, max_length)
        except _TooLong:
            continue
        if min_length <= len(out) <= max_length:
            return out, value
    raise ValueError(f"could not generate a ListOps expression with length in [{min_length}, {max_length}] "
                     f"(max_depth={max_depth}, max_args={max_args}) in {max_tries} tries; widen the range")


def evaluate(tokens: List[str]) -> int:
    """Value of a token list (stack evaluation; independent of the generator)."""
    stack: List[list] = []
    result: Optional[int] = None
    for t in tokens:
        if t.startswith("["):
            stack.append([t[1:]])
        elif t == "]":
            op, *args = stack.pop()
            v = _apply(op, args)
            if stack:
                stack[-1].append(v)
            else:
                result = v
        else:
            if stack:
                stack[-1].append(int(t))
            else:
                result = int(t)
    if stack or result is None:
        raise ValueError("malformed ListOps expression")
    return result


def tokenize(expression: str) -> List[str]:
    """LRA text form (``"( [MAX 2 9 ) ]"``-style, parentheses optional) -> token list."""
    return [t for t in expression.replace("(", " ").replace(")", " ").split() if t]


@register_dataset("listops", help="Long-Range-Arena ListOps expressions from the task's grammar (generated)")
def listops(split: str = "train", num_train: int = 2000, num_test: int = 500, min_length: int = 32,
            max_length: int = 256, max_depth: int = 10, max_args: int = 10, op_prob: float = 0.25,
            seed: int = 0) -> SequenceDataset:
    """Generated ListOps ``split`` ("train" / "test"; "val" = "test"), padded to ``max_length``."""
    split = check_split("listops", split)
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    if max_args < 2 or max_depth < 1:
        raise ValueError(f"need max_args >= 2 and max_depth >= 1, got {max_args}, {max_depth}")
    n = num_train if split == "train" else num_test
    if n <= 0:
        raise ValueError(f"num_{split} must be a positive integer, got {n!r}")
    rng = random.Random(f"listops-{seed}-{split}")
    tokens = torch.zeros(n, max_length, dtype=torch.long)
    lengths = torch.zeros(n, dtype=torch.long)
    labels = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        toks, value = generate_expression(rng, min_length, max_length, max_depth, max_args, op_prob)
        tokens[i, : len(toks)] = torch.tensor([_STOI[t] for t in toks])
        lengths[i] = len(toks)
        labels[i] = value
    return SequenceDataset(tokens, lengths, labels, 10, VOCAB, pad_id=0, name=f"listops/{split}")
