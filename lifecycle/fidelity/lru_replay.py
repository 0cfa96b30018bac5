"""An LRU replay of a Mooncake trace, independent of the engine.

The yardstick for the engine's hit ratios: a few dozen lines that read the trace themselves
(``orjson``, ``gzip``) and keep an ``OrderedDict`` of block hashes in recency order. Nothing
from kvlife is imported, so a bug in the engine, its tier index or its trace reader cannot
leak into the figures it is compared against.

Semantics, the ones a prefix cache with instant stores has:

- Requests are replayed in trace order, each looked up and then inserted at once (a request's
  blocks are in the cache before the next request arrives: no compute or store time).
- A block is a *hit* only if it is in the cache and every earlier block of the same prompt
  hit (prefix semantics: a KV block is usable only after its whole prefix).
- Every block of the prompt is inserted at lookup time (or, if present, made most recent),
  hits and misses alike: the request computes what missed and stores it. When the cache
  holds more than ``capacity_blocks``, the least recently used block is evicted.
- ``blocks="all"`` counts every hash of the prompt, the partial last block included
  (Mooncake's own accounting of the trace). ``blocks="cacheable"`` counts (and inserts) only
  the full blocks before the one holding the last prompt token, ``(input_length - 1) //
  block_tokens`` per prompt: an engine always computes at least the last token, and stores
  only full blocks, which is how kvlife's run summary counts hit candidates.

The hit ratio is hits / counted blocks; the infinite-cache ratio (``capacity_blocks=None``)
is the theoretical maximum that capacity-limited ratios are quoted against.
"""

from __future__ import annotations

import gzip
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import orjson

BlockMode = Literal["all", "cacheable"]


@dataclass(frozen=True)
class Prompt:
    """What the replay needs of one trace line."""

    input_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReplayResult:
    capacity_blocks: int | None  # None: infinite
    blocks: int  # blocks counted
    hits: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


def read_prompts(path: str | os.PathLike[str], limit: int | None = None) -> list[Prompt]:
    """The prompts of a Mooncake JSON-lines trace (``.gz`` decompressed), in file order.

    Reads only ``input_length`` and ``hash_ids``; blank lines are skipped. No validation
    beyond what ``orjson`` and ``int`` do: kvlife's own reader checks traces, this one only
    has to be short and obviously right.
    """
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    prompts: list[Prompt] = []
    with opener(path, "rb") as lines:
        for raw in lines:
            if limit is not None and len(prompts) >= limit:
                break
            if raw.strip():
                record = orjson.loads(raw)
                prompts.append(Prompt(int(record["input_length"]), tuple(record["hash_ids"])))
    return prompts


def counted_blocks(prompt: Prompt, blocks: BlockMode, block_tokens: int) -> Sequence[int]:
    """The hashes of ``prompt`` that the replay counts and inserts."""
    if blocks == "all":
        return prompt.hash_ids
    return prompt.hash_ids[: (prompt.input_length - 1) // block_tokens]


def lru_replay(
    prompts: Iterable[Prompt],
    capacity_blocks: int | None,
    blocks: BlockMode = "all",
    block_tokens: int = 512,
) -> ReplayResult:
    """Replay ``prompts`` through an LRU cache of ``capacity_blocks`` blocks (None: infinite)."""
    if capacity_blocks is not None and capacity_blocks < 1:
        raise ValueError(f"capacity_blocks: expected None or an integer >= 1, got {capacity_blocks!r}")
    cache: OrderedDict[int, None] = OrderedDict()
    counted = 0
    hits = 0
    for prompt in prompts:
        prefix_hit = True
        for block in counted_blocks(prompt, blocks, block_tokens):
            counted += 1
            if block in cache:
                if prefix_hit:
                    hits += 1
                cache.move_to_end(block)
            else:
                prefix_hit = False
                cache[block] = None
                if capacity_blocks is not None and len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return ReplayResult(capacity_blocks, counted, hits)
