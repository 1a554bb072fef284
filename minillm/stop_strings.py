"""Stop strings matched all at once: an Aho-Corasick automaton over a request's stop list.

Checking every stop string with str.find after every token costs O(number of stops) per token per
sequence, inside the engine's step, so one request with 200,000 stop strings slowed every request in
the batch (reliability probe round 4, M2). The automaton reads each new character once, whatever the
number of stops: its state is the longest suffix of the text read so far that begins some stop
string, and each state knows which stop strings end there.

Which stop wins: the one that ends first in the text; of several that end at the same character, the
first in the request's list. That is what matching after every character gives, so the answer does
not depend on how the text was cut into tokens (str.find per stop, in list order, over a token's
whole text, could pick a later match of an earlier stop).

One automaton per distinct stop list is built and kept (a small LRU): a request's n sequences, and
the prompts of a many-prompt request, share it; each Sequence keeps only its current state (an int).
"""

from __future__ import annotations

from collections import OrderedDict, deque

_KEEP = 64  # automata kept for reuse: distinct stop lists among the requests in flight


class StopAutomaton:
    """goto[state][char] -> state, fail[state] -> state, best[state] -> index of the stop string
    that ends at this state (the lowest index among those that do), or -1."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        goto: list[dict[str, int]] = [{}]
        best = [-1]
        for index, stop in enumerate(stops):
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = goto[state][ch] = len(goto)
                    goto.append({})
                    best.append(-1)
                state = nxt
            if best[state] < 0:  # a repeated stop string keeps its first index
                best[state] = index
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:  # breadth first: a state's fail link is shallower, so it is final already
            state = queue.popleft()
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0)
                inherited = best[fail[nxt]]  # a stop that is a suffix of this one ends here too
                if inherited >= 0 and (best[nxt] < 0 or inherited < best[nxt]):
                    best[nxt] = inherited
                queue.append(nxt)
        self.goto, self.fail, self.best = goto, fail, best

    def scan(self, state: int, text: str, start: int) -> tuple[int, int, int]:
        """Read all of text[start:] from `state` (a match before min_tokens is ignored, and the text
        after it must still be read) -> (state after it, end of the first match or -1, stop index)."""
        goto, fail, best = self.goto, self.fail, self.best
        end = index = -1
        for pos in range(start, len(text)):
            ch = text[pos]
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if end < 0 and best[state] >= 0:
                end, index = pos + 1, best[state]
        return state, end, index


_cache: OrderedDict[tuple[str, ...], StopAutomaton] = OrderedDict()


def automaton(stops) -> StopAutomaton:
    """The automaton of this stop list (built once, shared while it is in use)."""
    key = tuple(stops)
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = StopAutomaton(key)
        while len(_cache) > _KEEP:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return found


class StopMatcher:
    """One sequence's place in its stop automaton. feed() is called with the whole text after each
    token and the length it had before, so every character is read exactly once."""

    __slots__ = ("automaton", "state")

    def __init__(self, stops):
        self.automaton, self.state = automaton(stops), 0

    def feed(self, text: str, start: int) -> tuple[int, str] | None:
        """-> (end of the first stop string that ends in text[start:], that string), or None."""
        self.state, end, index = self.automaton.scan(self.state, text, start)
        return None if end < 0 else (end, self.automaton.stops[index])
