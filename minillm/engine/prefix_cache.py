"""Prefix caching: find blocks whose K/V some earlier sequence already computed (chapter 06).

Two requests that begin with the same tokens (a system prompt, the earlier turns of a chat) compute
the same keys and values for those tokens: a token's K/V depend only on the tokens before it. So a
full block of K/V is named by *everything up to its end*, and a new sequence can borrow every block
whose name it shares instead of computing it. Two ways to find the names, over the same block pool:

  * HashPrefixCache (vLLM's automatic prefix caching): block i's key is hash(key of block i-1,
    tokens of block i), a chain, so one dict lookup per block finds the longest shared prefix.
  * RadixPrefixCache (SGLang's RadixAttention): a tree whose edges are blocks of token ids; the path
    from the root spells the prefix. Matching walks down; evicting removes leaves.

Both keep blocks that no sequence uses any more (reference count 0) instead of freeing them, and
give them back least-recently-used first when the pool runs dry. The BlockManager owns reference
counts; it tells the cache when a cached block becomes unused (`release`) or used again (`acquire`).
Only full blocks are cached: a partly written block's name is not known yet.

A block's K/V also depend on the weights that computed them: under a LoRA adapter (chapter 16) the
same tokens have other keys and values. `extra_key` (the adapter's lora_int_id; 0 for the base
model) starts each chain (hash) or picks the tree (radix), so a block computed under adapter A is
never found for adapter B or the base model (vLLM puts the LoRA id into its block hashes likewise).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from collections import OrderedDict

from .stats import EngineStats


def block_tokens(token_ids: list[int], block_size: int, num_blocks: int) -> list[tuple[int, ...]]:
    """The token ids of each of the first num_blocks full blocks."""
    return [tuple(token_ids[i * block_size : (i + 1) * block_size]) for i in range(num_blocks)]


def chain_keys(token_ids: list[int], block_size: int, num_blocks: int, extra_key: int = 0):
    """The name of each of the first num_blocks full blocks: key i = hash(key i-1, tokens of block i)."""
    # A cryptographic hash, not Python's hash(): that one is fast but not collision-resistant, and
    # one collision would hand a sequence another prompt's K/V (a wrong answer, or one user's text
    # leaking into another's). vLLM moved to SHA-256 for the same reason; BLAKE2b-128 is enough here.
    # An adapter's chain starts from its own seed (the base model's from b"", as before).
    key = b"" if not extra_key else b"lora" + array("q", [extra_key]).tobytes()
    for tokens in block_tokens(token_ids, block_size, num_blocks):
        key = hashlib.blake2b(key + array("q", tokens).tobytes(), digest_size=16).digest()
        yield key


class PrefixCache:
    """What the BlockManager needs from either structure."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.stats = EngineStats()  # its counters; the BlockManager shares the engine's with it
        # Called with (block, chain key) just before an evicted block is forgotten: the KV offload tier
        # (kv_offload.py) keeps a copy of it under the same name as chain_keys gives it
        self.on_evict = None

    def _key_of(self, block: int) -> bytes:
        """The chain key (chain_keys) of a cached block."""
        raise NotImplementedError

    def match(self, token_ids: list[int], max_blocks: int, extra_key: int = 0) -> list[int]:
        """Blocks holding the longest cached prefix of token_ids (at most max_blocks full blocks)
        computed under extra_key (an adapter id; 0: the base model)."""
        raise NotImplementedError

    def insert(self, token_ids: list[int], block_ids: list[int], extra_key: int = 0) -> None:
        """Record that block_ids[i] holds the K/V of full block i of token_ids, under extra_key."""
        raise NotImplementedError

    def __contains__(self, block: int) -> bool:
        raise NotImplementedError

    def release(self, block: int) -> None:
        """A cached block's last user let go of it: keep it, but it may be evicted."""
        raise NotImplementedError

    def acquire(self, block: int) -> None:
        """An evictable block is in use again."""
        raise NotImplementedError

    def evict(self) -> int | None:
        """Forget the least recently used evictable block and return it (None: nothing to evict)."""
        raise NotImplementedError

    @property
    def num_evictable(self) -> int:
        raise NotImplementedError

    def count(self, asked: int, hit: int) -> None:
        """Statistics of one admitted sequence: `asked` full blocks looked up, `hit` of them found."""
        self.stats.prefix_queries += 1
        self.stats.prefix_query_tokens += asked * self.block_size
        self.stats.prefix_hit_tokens += hit * self.block_size

    @property
    def queries(self) -> int:
        return self.stats.prefix_queries

    @property
    def query_tokens(self) -> int:
        return self.stats.prefix_query_tokens

    @property
    def hit_tokens(self) -> int:
        return self.stats.prefix_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Share of the full-block tokens asked for that were found."""
        return self.stats.prefix_hit_rate


class HashPrefixCache(PrefixCache):
    def __init__(self, block_size: int):
        super().__init__(block_size)
        self._block_of: dict[bytes, int] = {}  # chain hash -> block
        self._hash_of: dict[int, bytes] = {}  # block -> chain hash
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recently used first

    def _keys(self, token_ids: list[int], num_blocks: int, extra_key: int = 0):
        return chain_keys(token_ids, self.block_size, num_blocks, extra_key)

    def _key_of(self, block):
        return self._hash_of[block]

    def match(self, token_ids, max_blocks, extra_key=0):
        found = []
        for key in self._keys(token_ids, max_blocks, extra_key):
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def insert(self, token_ids, block_ids, extra_key=0):
        for key, block in zip(self._keys(token_ids, len(block_ids), extra_key), block_ids):
            if key not in self._block_of and block not in self._hash_of:  # first writer names it
                self._block_of[key], self._hash_of[block] = block, key

    def __contains__(self, block):
        return block in self._hash_of

    def release(self, block):
        self._lru[block] = None  # newest at the end

    def acquire(self, block):
        self._lru.pop(block, None)

    def evict(self):
        if not self._lru:
            return None
        block, _ = self._lru.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(block, self._hash_of[block])
        del self._block_of[self._hash_of.pop(block)]
        return block

    @property
    def num_evictable(self):
        return len(self._lru)


class _Node:
    __slots__ = ("block", "children", "last_used", "parent", "tokens")

    def __init__(self, tokens: tuple[int, ...], block: int, parent: _Node | None):
        self.tokens, self.block, self.parent = tokens, block, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0


class RadixPrefixCache(PrefixCache):
    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.root = _Node((), -1, None)
        self._roots: dict[int, _Node] = {0: self.root}  # one tree per adapter (extra_key)
        self._node_of: dict[int, _Node] = {}  # block -> its node
        self._evictable: set[int] = set()  # cached blocks with no user
        self._clock = itertools.count(1)
        # Candidates for eviction, (last_used, block), smallest first. An entry goes stale when its node
        # is used again, gets a child or leaves; evict() skips stale entries instead of searching the
        # whole tree, so an eviction costs O(log n) in a pool of a hundred thousand blocks, not O(n).
        # (Two leaves never share a last_used: one clock tick touches one path, which has one leaf.)
        self._leaves: list[tuple[int, int]] = []

    def _candidate(self, node: _Node) -> None:
        if node.block in self._evictable and not node.children:
            heapq.heappush(self._leaves, (node.last_used, node.block))
            if len(self._leaves) > 2 * len(self._evictable) + 64:  # mostly stale (a pool that never fills)
                self._leaves = [(self._node_of[b].last_used, b) for b in self._evictable
                                if not self._node_of[b].children]
                heapq.heapify(self._leaves)

    def _key_of(self, block):
        # the tokens on the path from the root spell the block's prefix; its root names the adapter
        node, blocks = self._node_of[block], []
        while node.parent is not None:
            blocks.append(node.tokens)
            node = node.parent
        extra_key = next(k for k, r in self._roots.items() if r is node)
        tokens = [t for b in reversed(blocks) for t in b]
        *_, key = chain_keys(tokens, self.block_size, len(blocks), extra_key)
        return key

    def _root(self, extra_key: int) -> _Node:
        root = self._roots.get(extra_key)
        if root is None:
            root = self._roots[extra_key] = _Node((), -1, None)
        return root

    def match(self, token_ids, max_blocks, extra_key=0):
        node, found, now = self._root(extra_key), [], next(self._clock)
        for tokens in block_tokens(token_ids, self.block_size, max_blocks):
            node = node.children.get(tokens)
            if node is None:
                break
            node.last_used = now
            self._candidate(node)  # (found blocks are usually acquired next; if not, the new time counts)
            found.append(node.block)
        return found

    def insert(self, token_ids, block_ids, extra_key=0):
        node, now = self._root(extra_key), next(self._clock)
        for tokens, block in zip(block_tokens(token_ids, self.block_size, len(block_ids)), block_ids):
            child = node.children.get(tokens)
            if child is None:
                if block in self._node_of:  # already names another path (cannot happen for a chain)
                    return
                child = node.children[tokens] = _Node(tokens, block, node)
                self._node_of[block] = child
            elif child.block != block:
                # Another sequence computed this block too and named it first. Stop here, so a cached
                # node's users always hold its parent too: then an unused node's subtree is all unused,
                # and whenever anything is evictable, some leaf is.
                return
            child.last_used = max(child.last_used, now)
            self._candidate(child)
            node = child

    def __contains__(self, block):
        return block in self._node_of

    def release(self, block):
        self._evictable.add(block)
        node = self._node_of[block]
        node.last_used = next(self._clock)
        self._candidate(node)

    def acquire(self, block):
        self._evictable.discard(block)

    def evict(self):
        # Only leaves: an inner node's children are named through it. The least recently used leaf goes.
        while self._leaves:
            last_used, block = heapq.heappop(self._leaves)
            node = self._node_of.get(block)
            if node is None or block not in self._evictable or node.children or node.last_used != last_used:
                continue  # stale: evicted already, in use, no longer a leaf, or used since
            if self.on_evict is not None:
                self.on_evict(block, self._key_of(block))
            del self._node_of[block]
            del node.parent.children[node.tokens]
            self._evictable.discard(block)
            if node.parent.block != -1:  # not a root (the base model's, or an adapter's)
                self._candidate(node.parent)  # it may have just become a leaf
            return block
        return None

    @property
    def num_evictable(self):
        return len(self._evictable)


def make_prefix_cache(kind: str | None, block_size: int) -> PrefixCache | None:
    if kind is None:
        return None
    if kind == "hash":
        return HashPrefixCache(block_size)
    if kind == "radix":
        return RadixPrefixCache(block_size)
    raise ValueError(f"enable_prefix_caching must be None/False, True/'hash' or 'radix', not {kind!r}")
