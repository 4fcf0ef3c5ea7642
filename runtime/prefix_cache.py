"""The KV of recent prompts' prefixes, kept across requests (`serve --prefix-cache SIZE`, `batch --prefix-cache`):
a request whose prompt starts with a kept prefix copies that prefix's KV into its slot and prefills only the rest.

Prompts are cut into blocks of `BLOCK_TOKENS` tokens; a block is kept under its parent block and its own tokens
(a tree of blocks, as vLLM's and SGLang's prefix caches are), so prompts that share a prefix share its blocks and a
prompt reuses every whole block it starts with. A block holds its tokens' KV columns of every attention, copied out
of the slot when its prompt was prefilled. Blocks are kept under a budget in bytes and the least recently used
leaf goes first (a prompt's blocks are touched leaf first, so parents stay younger than their children)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

BLOCK_TOKENS = 16


@dataclass
class Block:
    """A block of a kept prompt: its KV [attention pasts, kv heads, BLOCK_TOKENS, head dim] and its place in the
    tree (the key of its parent block, how many kept blocks continue it)."""

    kv: np.ndarray
    parent: tuple | None
    children: int = 0


class PrefixCache:
    """Kept prompt prefixes' KV under a byte budget, least recently used out first. Used on the scheduler's thread
    only."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.blocks: OrderedDict[tuple, Block] = OrderedDict()  # (parent key, tokens) -> block; oldest first
        self.reused_tokens = 0  # prompt tokens requests took from here instead of computing them
        self.evicted_blocks = 0

    def _keys(self, tokens: list[int]) -> list[tuple]:
        """The keys of the whole blocks `tokens` starts with, in order (each names its parent's)."""
        keys, parent = [], None
        for begin in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            parent = (parent, tuple(tokens[begin : begin + BLOCK_TOKENS]))
            keys.append(parent)
        return keys

    def longest(self, tokens: list[int]) -> list[tuple]:
        """The keys of the kept blocks `tokens` starts with (its longest kept prefix), touched."""
        found = []
        for key in self._keys(tokens):
            if key not in self.blocks:
                break
            found.append(key)
        for key in reversed(found):  # parents after children: a parent is never older than its children
            self.blocks.move_to_end(key)
        return found

    def kv_of(self, keys: list[tuple]) -> list[np.ndarray]:
        """The KV of these blocks, in order (each [pasts, kv heads, BLOCK_TOKENS, head dim])."""
        return [self.blocks[key].kv for key in keys]

    def missing(self, tokens: list[int]) -> tuple[int, int]:
        """The token range of `tokens`' whole blocks not kept yet: (first, end); first == end when none are."""
        keys = self._keys(tokens)
        kept = len(self.longest(tokens))
        return kept * BLOCK_TOKENS, len(keys) * BLOCK_TOKENS

    def add(self, tokens: list[int], first: int, kv: np.ndarray) -> None:
        """Keep the blocks of `tokens` from token `first` on (a multiple of BLOCK_TOKENS), whose KV `kv` holds
        along its tokens' axis; the least recently used leaves go to make room. A block larger than the whole
        budget is not kept."""
        keys = self._keys(tokens)
        for index in range(first // BLOCK_TOKENS, len(keys)):
            key = keys[index]
            if key in self.blocks:
                continue
            offset = (index - first // BLOCK_TOKENS) * BLOCK_TOKENS
            block = np.ascontiguousarray(kv[:, :, offset : offset + BLOCK_TOKENS])
            if not self._make_room(block.nbytes, keep=key[0]):
                break
            self.blocks[key] = Block(block, key[0])
            self.bytes += block.nbytes
            if key[0] is not None:
                self.blocks[key[0]].children += 1
        self.longest(tokens)  # the path touched: its parents younger than its children

    def _make_room(self, nbytes: int, keep: tuple | None) -> bool:
        """Evict least recently used leaves until `nbytes` more fit (never the block `keep`, the one the next block
        continues); False when they cannot."""
        while self.bytes + nbytes > self.budget_bytes:
            victim = next((k for k, b in self.blocks.items() if b.children == 0 and k != keep), None)
            if victim is None:
                return False
            block = self.blocks.pop(victim)
            self.bytes -= block.kv.nbytes
            self.evicted_blocks += 1
            if block.parent is not None:
                self.blocks[block.parent].children -= 1
        return True
