"""A grammar (rules of byte-level IR that call each other) -> a pushdown automaton over bytes.

Each rule that must stay a rule becomes a DFA whose call edges push the callee (automaton.py). A rule
that is not recursive is simply inlined where it is used, so the only calls left are the ones a
finite automaton cannot express (nesting: JSON values inside arrays inside values). A grammar without
recursion is therefore a single DFA, and costs a table lookup per byte.

The automaton's configuration is a *stack* of nodes (an interned int, see PDA.stack); a node is one
state of one rule's DFA, numbered globally. A caller's frame holds the state to return to. A configuration
may be ambiguous (two parses of the same prefix), so the matcher carries a set of stacks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from . import ir
from .automaton import DFA, compile_dfa

ROOT = "$root"
MAX_STACKS = 256  # ambiguous parses alive at once; past this the grammar is too ambiguous to serve
MAX_DEPTH = 100_000


@dataclass
class Grammar:
    """rules: name -> IR expression; root: the start rule's name."""

    rules: dict[str, object]
    root: str = "root"
    source: str = field(default="grammar", compare=False)


class PDA:
    """The compiled grammar: global node tables plus the per-rule DFAs.

    trans: [N, 256] int32 node after a byte, -1 = none. calls[n]: (callee start node, return node).
    pop[n]: the rule may end here and hand back to its caller (never for the root rule, whose end
    is the end of the output). rule_of[n]: the rule index of node n.
    """

    def __init__(self, dfas: dict[str, DFA]):
        self.names = list(dfas)
        self.dfas = dfas
        offsets, n = {}, 0
        for name, d in dfas.items():
            offsets[name] = n
            n += d.num_states
        self.offsets = offsets
        self.num_nodes = n
        self.trans = np.full((n, 256), -1, dtype=np.int32)
        self.final = np.zeros(n, dtype=bool)
        self.rule_of = np.zeros(n, dtype=np.int32)
        self.calls: list[list[tuple[int, int]]] = []
        for r, (name, d) in enumerate(dfas.items()):
            o = offsets[name]
            self.trans[o : o + d.num_states] = np.where(d.trans >= 0, d.trans + o, -1)
            self.final[o : o + d.num_states] = d.final
            self.rule_of[o : o + d.num_states] = r
            for s in range(d.num_states):
                self.calls.append([(offsets[q] + dfas[q].start, o + ret) for q, ret in d.calls[s]])
        self.start = offsets[ROOT] + dfas[ROOT].start
        self.pop = self.final & (self.rule_of != self.names.index(ROOT))
        self.has_calls = any(self.calls)
        self.trans_list = self.trans.tolist()  # Python lists index faster than numpy one element at a time
        self.end_ok = self._nullable_end()
        self._intern: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._node: list[int] = []
        self._parent: list[int] = []
        self._depth: list[int] = []
        self._end: list[bool] = []
        self.follow, self.escape = self._escape_bytes()

    def _nullable_end(self) -> np.ndarray:
        """end_ok[n]: from node n the rule can finish without reading a byte (it is final, or calls
        rules that may be empty and returns to such a node)."""
        ok = self.final.copy()
        starts_nullable = {}
        changed = True
        while changed:
            changed = False
            for n in range(self.num_nodes):
                if ok[n]:
                    continue
                for c, r in self.calls[n]:
                    starts_nullable[c] = bool(ok[c])
                    if ok[c] and ok[r]:
                        ok[n] = changed = True
                        break
        return ok

    def _escape_bytes(self):
        """follow[r]: [256] bool, the bytes that may come right after rule r ends, in any caller;
        escape[n]: [256] bool, the bytes node n may read by leaving its frame (a call, or a return).

        The token index uses them to send to the exact (Python) walk only the tokens that could
        really cross a rule boundary at the byte where they meet one."""
        N, R, root = self.num_nodes, len(self.names), self.names.index(ROOT)
        direct = self.trans >= 0  # [N, 256]
        readable = direct.copy()  # bytes readable from n inside its frame, calls included
        changed = True
        while changed:
            changed = False
            for n in range(N):
                for c, r in self.calls[n]:
                    new = readable[n] | readable[c] | (readable[r] if self.end_ok[c] else False)
                    if (new != readable[n]).any():
                        readable[n] = new
                        changed = True
        follow = np.zeros((R, 256), dtype=bool)
        changed = True
        while changed:
            changed = False
            for n in range(N):
                for c, r in self.calls[n]:
                    rule = self.rule_of[c]
                    new = follow[rule] | readable[r]
                    if self.end_ok[r] and self.rule_of[r] != root:  # the caller may end right after
                        new = new | follow[self.rule_of[r]]
                    if (new != follow[rule]).any():
                        follow[rule] = new
                        changed = True
        via_calls = np.zeros((N, 256), dtype=bool)  # bytes a callee (or what follows an empty one) reads
        for n in range(N):
            for c, r in self.calls[n]:
                via_calls[n] |= readable[c] | (readable[r] if self.end_ok[c] else False)
        escape = via_calls
        escape |= np.where(self.end_ok[:, None] & (self.rule_of != root)[:, None],
                           follow[self.rule_of], False)
        return follow, escape

    # ---- stacks, hash-consed -------------------------------------------------------------------------
    #
    # A stack is an int: the id of its top frame (node, parent id), interned so that equal stacks are
    # the same int. Push, pop and replace-the-top are O(1), a set of stacks hashes in O(its size), and
    # a deep nesting costs no copying: the tuples this replaced made "((((((" quadratic.

    def stack(self, parent: int, node: int) -> int:
        """The stack `node` on top of `parent` (-1: nothing below)."""
        key = (parent, node)
        s = self._intern.get(key)
        if s is None:
            return self._new_stack(key, parent, node)
        return s

    def _new_stack(self, key, parent: int, node: int) -> int:
        # Under a lock: an engine may fill one request's mask in a helper thread while the main
        # thread accepts another's token, and the four appends below must stay in step.
        with self._lock:
            s = self._intern.get(key)
            if s is not None:
                return s
            depth = 1 if parent < 0 else self._depth[parent] + 1
            if depth > MAX_DEPTH:
                raise ValueError(f"grammar nesting deeper than {MAX_DEPTH}")
            s = len(self._node)
            self._intern[key] = s
            self._node.append(node)
            self._parent.append(parent)
            self._depth.append(depth)
            self._end.append(bool(self.end_ok[node]) and (parent < 0 or self._end[parent]))
            return s

    def frames(self, s: int) -> list[int]:
        """The nodes of a stack, bottom first (for tests and debugging)."""
        out = []
        while s >= 0:
            out.append(self._node[s])
            s = self._parent[s]
        return out[::-1]

    # ---- walking bytes through stacks ---------------------------------------------------------------

    def closure(self, stacks, relative: bool = False):
        """Every configuration reachable without reading a byte: push callees, pop finished rules.

        relative=True treats the bottom frame as a rule whose caller is unknown: popping it is
        reported (second result: the set of rules that popped) instead of followed. That is how a
        node's token classes are precomputed without knowing the stack below (token_index.py)."""
        out, work, escaped = set(), list(stacks), set()
        calls, pop, node, parent, stack = self.calls, self.pop, self._node, self._parent, self.stack
        while work:
            s = work.pop()
            if s in out:
                continue
            out.add(s)
            n = node[s]
            for c, r in calls[n]:
                work.append(stack(stack(parent[s], r), c))
            if pop[n]:
                if parent[s] >= 0:
                    work.append(parent[s])
                elif relative:
                    escaped.add(int(self.rule_of[n]))
        return out, escaped

    def step(self, stacks, byte: int) -> set:
        """Configurations after reading one byte from already-closed ones."""
        out = set()
        tl, node, parent, stack = self.trans_list, self._node, self._parent, self.stack
        for s in stacks:
            m = tl[node[s]][byte]
            if m >= 0:
                out.add(stack(parent[s], m))
        if len(out) > MAX_STACKS:
            raise ValueError(f"the grammar is ambiguous beyond {MAX_STACKS} parses of one prefix")
        return out

    def walk(self, stacks, data: bytes, relative: bool = False):
        """Read `data` from `stacks`. Returns (stacks after it, escaped): escaped is True when, in
        relative mode, some parse popped the bottom frame with bytes still to read that a caller of
        its rule could read next."""
        escaped = False
        for i, b in enumerate(data):
            stacks, esc = self.read_byte(stacks, b, i, relative)
            escaped |= esc
            if not stacks:
                break
        return stacks, escaped

    def read_byte(self, stacks, b: int, pos: int, relative: bool = False):
        """One byte: close, then step. pos is the byte's place in the token (a pop of the bottom
        frame before the first byte is the caller's business: TokenIndex.exit0)."""
        if not self.has_calls:
            return self.step(stacks, b), False
        closed, popped = self.closure(stacks, relative)
        esc = pos > 0 and any(self.follow[r, b] for r in popped)
        return self.step(closed, b), esc

    def walk_sorted(self, stacks, datas: list[bytes], relative: bool = False):
        """walk() for many byte strings sorted in byte order, sharing the work on common prefixes
        (a trie walk without building the trie): ' therapists' and ' theology' read ' th' once."""
        out = []
        path = [(stacks, False)]  # path[i]: (stacks, escaped) after the first i bytes of `prev`
        prev = b""
        for d in datas:
            lcp = 0
            for x, y in zip(prev, d):
                if x != y:
                    break
                lcp += 1
            del path[min(lcp, len(path) - 1) + 1 :]
            cur, esc = path[-1]
            i = len(path) - 1
            while i < len(d) and cur:
                cur, e = self.read_byte(cur, d[i], i, relative)
                esc |= e
                path.append((cur, esc))
                i += 1
            out.append((cur, esc))
            prev = d
        return out

    def fullmatch(self, data: bytes) -> bool:
        """Is `data` a complete sentence of the grammar?"""
        stacks, _ = self.walk({self.stack(-1, self.start)}, data)
        if stacks and self.has_calls:
            stacks, _ = self.closure(stacks)
        return any(self._end[s] for s in stacks)

    def accepts_end(self, s: int) -> bool:
        """Can the output end in this configuration (is EOS allowed)?"""
        return self._end[s]


def compile_grammar(grammar: Grammar) -> PDA:
    """Grammar -> PDA. Refuses undefined rules, left recursion and empty languages by name."""
    rules = grammar.rules
    if grammar.root not in rules:
        raise ValueError(f"{grammar.source}: no start rule {grammar.root!r}")
    refs = {name: _refs(body) for name, body in rules.items()}
    for name, rs in refs.items():
        for r in rs:
            if r not in rules:
                raise ValueError(f"{grammar.source}: rule {name!r} refers to undefined rule {r!r}")
    recursive = _cycle_breakers(refs, grammar.root)

    expanded: dict[str, object] = {}

    def expand(node):
        if isinstance(node, ir.Ref):
            if node.name in recursive:
                return node
            if node.name not in expanded:
                expanded[node.name] = expand(rules[node.name])
            return expanded[node.name]
        if isinstance(node, (ir.Seq, ir.Alt)):
            return type(node)(tuple(expand(i) for i in node.items))
        if isinstance(node, ir.Rep):
            return ir.Rep(expand(node.item), node.lo, node.hi)
        return node

    bodies = {ROOT: expand(ir.Ref(grammar.root))}
    todo = list(_refs(bodies[ROOT]))
    while todo:
        name = todo.pop()
        if name in bodies:
            continue
        bodies[name] = expand(rules[name])
        todo += _refs(bodies[name])
    dfas = {name: compile_dfa(body, f"{grammar.source}: rule {name if name != ROOT else grammar.root!r}")
            for name, body in bodies.items()}
    pda = PDA(dfas)
    _check_left_recursion(pda, grammar.source)
    return pda


def _refs(node) -> set[str]:
    if isinstance(node, ir.Ref):
        return {node.name}
    if isinstance(node, (ir.Seq, ir.Alt)):
        return set().union(*(_refs(i) for i in node.items)) if node.items else set()
    if isinstance(node, ir.Rep):
        return _refs(node.item)
    return set()


def _cycle_breakers(refs: dict, root: str) -> set[str]:
    """The rules that stay rules (call targets): the targets of the back edges of a depth-first walk
    from the root. Every cycle holds a back edge, so inlining all the other rules terminates, and
    few calls remain: in `lst ::= "[" item* "]"`, `item ::= [a-z]+ | lst`, only lst is called; item is
    written into it. Fewer calls mean fewer tokens that cross a rule boundary mid-token."""
    keep, done, on_path = set(), set(), set()

    def dfs(n):
        on_path.add(n)
        for m in sorted(refs[n]):
            if m in on_path:
                keep.add(m)
            elif m not in done:
                dfs(m)
        on_path.discard(n)
        done.add(n)

    dfs(root)
    return keep


def _check_left_recursion(pda: PDA, source: str) -> None:
    """A rule that can call itself before reading a byte would push forever: refuse it."""
    starts = {pda.offsets[name] + pda.dfas[name].start: name for name in pda.names}
    for start, name in starts.items():
        seen, work = set(), [start]
        while work:
            n = work.pop()
            for c, r in pda.calls[n]:
                if c == start:
                    raise ValueError(f"{source}: rule {name!r} is left-recursive (it can call itself "
                                     "before reading anything); rewrite it with repetition")
                for m in (c, r) if pda.end_ok[c] else (c,):
                    if m not in seen:
                        seen.add(m)
                        work.append(m)
