"""The whole-or-split answers kept per call shape (comm/shortcuts.py), without a communicator: what
the op's question (decide) and the backend's (answer) return, when the calibration is asked, the
arbiter's hand-off between the two questions of one call, and what clears or refuses an entry."""
from __future__ import annotations

from braid.comm.shortcuts import MAX_SHAPES, Shortcuts


class _Arbiter:
    """Says whole for the keys in `whole`, and counts every question per key."""

    def __init__(self, whole=()):
        self.whole_keys, self.asked = set(whole), {}

    def whole(self, key):
        self.asked[key] = self.asked.get(key, 0) + 1
        return key in self.whole_keys

    def settled_whole(self, key):
        return key in self.whole_keys


def _r(*rest):
    """An op's `rest`: (valid, its name, its bytes, the arbiter's key), as given."""
    return rest


def _make(native=True, whole=(), learn=False):
    calls = []

    def native_for(name, nbytes):
        calls.append((name, nbytes))
        return native
    state = {"usable": True}
    s = Shortcuts(native_for, _Arbiter(whole), lambda: state["usable"])
    s.learn = learn
    return s, calls, state


def test_a_shape_is_worked_out_once_and_kept():
    s, calls, _ = _make(native=True)
    for _ in range(3):
        assert s.decide("ar", 10, ("f32", "sum"), _r, True, "all_reduce", 40, ("ar", 10))
    assert calls == [("all_reduce", 40)] and s.ar[10] == ("f32", "sum", True)
    # a shape its entry says is whole is settled by the entry alone: `rest` is not asked
    asked = []
    assert s.decide("ar", 10, ("f32", "sum"), lambda: asked.append(1))
    assert s.answer("ar", 10, ("f32", "sum"), lambda: asked.append(1)) and asked == []
    # other facts for the same element count: worked out again
    assert s.decide("ar", 10, ("bf16", "sum"), _r, True, "all_reduce", 20, ("ar", 10)) and len(calls) == 2
    # a shape the native call cannot take is never whole, and the calibration is not asked
    s2, calls2, _ = _make(native=True)
    assert not s2.decide("rs", 9, ("f32", "sum", 4), _r, False, "reduce_scatter", 36, ("rs", 9))
    assert calls2 == [] and s2.rs[9][-1] is False


def test_the_backend_answers_only_for_shapes_the_op_has_seen():
    s, _, _ = _make(native=True)
    assert not s.answer("ag", 8, ("f32", 16), _r, True, "", 0, ("ag", 8))       # not seen: the op decides
    s.decide("ag", 8, ("f32", 16), _r, True, "all_gather", 32, ("ag", 8))
    assert s.answer("ag", 8, ("f32", 16), _r, True, "", 0, ("ag", 8))
    assert not s.answer("ag", 8, ("f32", 24), _r, True, "", 0, ("ag", 8))       # other facts


def test_a_split_shape_on_trial_asks_the_arbiter_once_per_call():
    key = ("bc", 5, "f32", 0)
    s, _, _ = _make(native=False, learn=True)
    assert not s.decide("bc", 5, ("f32", 0), _r, True, "broadcast", 20, key)   # split, asked once
    assert s.arbiter.asked[key] == 1
    # the backend asks first and hears "split": the op's own question takes that answer
    assert not s.answer("bc", 5, ("f32", 0), _r, True, "", 0, key) and s.said == key
    assert not s.decide("bc", 5, ("f32", 0), _r, True, "broadcast", 20, key)
    assert s.arbiter.asked[key] == 2 and s.said is None
    # a hand-off for another shape is dropped, and this call asks
    s.said = ("bc", 6, "f32", 0)
    s.decide("bc", 5, ("f32", 0), _r, True, "broadcast", 20, key)
    assert s.arbiter.asked[key] == 3 and s.said is None
    # the arbiter says whole: both questions forward
    s.arbiter.whole_keys.add(key)
    assert s.answer("bc", 5, ("f32", 0), _r, True, "", 0, key) and s.decide("bc", 5, ("f32", 0), _r, True, "broadcast", 20, key)
    # without trials (fixed shares, check mode) the arbiter is never asked
    s.learn = False
    n = s.arbiter.asked[key]
    assert not s.decide("bc", 5, ("f32", 0), _r, True, "broadcast", 20, key)
    assert not s.answer("bc", 5, ("f32", 0), _r, True, "", 0, key) and s.arbiter.asked[key] == n


def test_cleared_bounded_and_never_whole_once_unusable():
    s, calls, state = _make(native=True)
    for op in Shortcuts.OPS:
        s.put(op, 1, ("x",), True)
    s.clear()
    assert all(not s.table(op) for op in Shortcuts.OPS)
    for n in range(MAX_SHAPES + 10):
        s.put("a2a", n, ("x",), True)
    assert len(s.a2a) <= MAX_SHAPES
    state["usable"] = False                 # closed or aborted
    assert not s.decide("ar", 3, ("f32", "sum"), _r, True, "all_reduce", 12, ("ar", 3))
    assert s.ar[3][-1] is False


def test_settled_shapes_are_the_kept_whole_and_the_arbiters_whole_verdicts():
    """What the backend's hand-off may forward: entries kept whole, and split entries whose
    arbiter key (op, elements, then the entry's leading facts) has a whole verdict, only while
    learning; every op's key form."""
    s, _, _ = _make(native=False, whole=[("ar", 20, "f32", "sum"), ("rs", 8, "f32", "avg"), ("ag", 4, "bf16")],
                    learn=True)
    s.put("ar", 10, ("f32", "sum"), True)        # kept whole
    s.put("ar", 20, ("f32", "sum"), False)       # split, sent back whole
    s.put("ar", 30, ("f32", "sum"), False)       # split, no whole verdict
    s.put("rs", 8, ("f32", "avg", 4), False)
    s.put("ag", 4, ("bf16", 8), False)
    s.put("ag", 5, ("bf16", 10), False)
    assert s.settled("ar") == {10: ("f32", "sum"), 20: ("f32", "sum")}
    assert s.settled("rs") == {8: ("f32", "avg", 4)}
    assert s.settled("ag") == {4: ("bf16", 8)}
    s.learn = False                               # fixed shares or check mode: the kept ones only
    assert s.settled("ar") == {10: ("f32", "sum")} and s.settled("ag") == {}


def test_clearing_tells_the_hand_off():
    s, _, _ = _make()
    told = []
    s.on_clear = lambda: told.append(1)
    s.put("ag", 4, ("bf16", 8), True)
    s.clear()
    assert told == [1] and s.settled("ag") == {}


def test_a_split_shape_outside_a_trial_is_settled_by_its_entry():
    s, calls, _ = _make(native=False)
    assert not s.decide("ag", 8, ("f32", 16), _r, True, "all_gather", 32, ("ag", 8))
    assert calls == [("all_gather", 32)] and s.ag[8] == ("f32", 16, False)
    # a repeat with the same facts, no trial: `rest` is not asked, the answer stays split
    asked = []
    assert not s.decide("ag", 8, ("f32", 16), lambda: asked.append(1) or (True, "all_gather", 32, ("ag", 8)))
    assert asked == [] and calls == [("all_gather", 32)]
    # on trial the same shape asks `rest` for the arbiter's key, and the arbiter decides
    s.learn = True
    s.arbiter.whole_keys.add(("ag", 8))
    assert s.decide("ag", 8, ("f32", 16), lambda: asked.append(1) or (True, "all_gather", 32, ("ag", 8)))
    assert asked == [1] and s.arbiter.asked == {("ag", 8): 1}


def test_an_op_without_a_trial_never_asks_the_arbiter():
    """reduce keeps its answers like the others but has no in-job trial: its rest's key is None."""
    s, calls, _ = _make(native=False, learn=True)
    for _ in range(3):
        assert not s.decide("rd", 6, ("f32", "sum", 1), _r, True, "reduce", 24, None)
    # worked out once from the calibration; on trial `rest` is asked again, but not the arbiter
    assert calls == [("reduce", 24)] and s.rd[6] == ("f32", "sum", 1, False) and s.arbiter.asked == {}
    s2, calls2, _ = _make(native=True, learn=True)
    assert all(s2.decide("rd", 6, ("f32", "sum", 0), _r, True, "reduce", 24, None) for _ in range(3))
    assert calls2 == [("reduce", 24)]
    # another root is another shape's facts: worked out again; clear() empties reduce's table too
    assert s2.decide("rd", 6, ("f32", "sum", 1), _r, True, "reduce", 24, None) and len(calls2) == 2
    s2.clear()
    assert s2.rd == {}
