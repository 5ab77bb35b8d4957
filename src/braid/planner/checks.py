"""Argument checks for the planner's public entry points (router, topology builders, NIC choice).

Bad input raises `braid.errors.MisuseError` (a ValueError) whose message names the value, where it
was, what is allowed and how to fix it; nothing is clamped, dropped or converted behind the
caller's back. Pure Python + numpy, no torch.

Traffic matrices: n rows of n entries (n = the topology's GPU count), each entry an int or float
(numpy integer and floating scalars too), finite and >= 0; bools and strings are refused. Floats
are accepted and the router floors them to whole bytes (it always has). The diagonal, a GPU's bytes
to itself, crosses no link and is ignored, but must hold a valid count like every other cell.
Off-diagonal demands stay at or below 2**52 bytes, where float64 still holds every whole byte count.
"""
from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence

from braid.errors import MisuseError

_PLAIN = frozenset((int, float))
_LIMIT = 2.0 ** 52
# 2**52 as the bits of a float64: a valid entry's bits, read as an unsigned integer, are at most
# this; negatives (sign bit), NaN and infinities all read larger, so one max() tests them all
_LIMIT_BITS = 0x4330000000000000


def _tail(hint: str) -> str:
    return f"; {hint}" if hint else ""


def whole(value, what: str, low: int = 1, hint: str = "") -> int:
    """`value` as an int >= low (numpy integers too); bools, floats and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MisuseError(f"{what} = {value!r} ({type(value).__name__}): must be a whole number >= {low}"
                          f"{_tail(hint)}")
    if value < low:
        raise MisuseError(f"{what} = {value!r}: must be a whole number >= {low}{_tail(hint)}")
    return int(value)


def real(value, what: str, low: float = 0.0, strict: bool = True, high: float | None = None,
         hint: str = "") -> float:
    """`value` as a finite float > low (>= low when not strict, <= high when given)."""
    allowed = (f"a finite number {'>' if strict else '>='} {low:g}" if high is None
               else f"a number in [{low:g}, {high:g}]")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MisuseError(f"{what} = {value!r} ({type(value).__name__}): must be {allowed}{_tail(hint)}")
    v = float(value)
    if not math.isfinite(v) or v < low or (strict and v == low) or (high is not None and v > high):
        raise MisuseError(f"{what} = {value!r}: must be {allowed}{_tail(hint)}")
    return v


def rate(value, what: str, hint: str = "") -> float:
    """A bandwidth or capacity in GB/s: finite and > 0."""
    return real(value, what, hint=hint or "rates are GB/s per direction")


def _show(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 1e16 else repr(v)


def _number(x, where: str) -> float:
    """One matrix cell off the fast path, as a float, or the reason it is not a byte count."""
    if type(x) is int or type(x) is float:
        try:
            return float(x)
        except OverflowError:
            raise MisuseError(f"{where} = an int of {len(str(x))} digits: above 2**52 bytes; split it "
                              f"before routing") from None
    import numpy as np
    if isinstance(x, (bool, np.bool_)):
        raise MisuseError(f"{where} = {x!r}: a bool ({str(bool(x)).lower()} in JSON) is not a byte count; "
                          f"pass the number of bytes, an int or float (e.g. 1 or 0)")
    if isinstance(x, (str, bytes)):
        raise MisuseError(f"{where} = {x!r} is a string; pass byte counts as numbers (100, not \"100\"; "
                          f"in JSON leave out the quotes)")
    if x is None:
        raise MisuseError(f"{where} = None (null in JSON): not a byte count; pass 0 for no traffic")
    if isinstance(x, numbers.Real):                # numpy scalars, Fraction
        return float(x)
    raise MisuseError(f"{where} = {x!r} ({type(x).__name__}): not a byte count; pass an int or float")


def _is_rows(x) -> bool:
    import numpy as np
    return isinstance(x, np.ndarray) or (isinstance(x, Sequence) and not isinstance(x, (str, bytes)))


def _convert(matrix, n: int, topo: str, name: str):
    """The matrix off the fast path (arrays, tuples, numpy scalars, bad shapes or cells)."""
    import numpy as np
    need = f"{topo} needs {n} x {n}: {n} rows of {n} byte counts (row = source GPU, column = destination)"
    if isinstance(matrix, np.ndarray):
        if matrix.shape != (n, n):
            raise MisuseError(f"{name} has shape {matrix.shape}; {need}")
        kind = matrix.dtype.kind
        if kind in "iuf":
            return matrix.astype(np.float64).ravel()      # a copy: the caller's array stays as it was
        if kind == "b":
            raise MisuseError(f"{name} is an array of bools; {need} (e.g. {name}.astype(int) * bytes)")
        if kind != "O":
            raise MisuseError(f"{name} has dtype {matrix.dtype}; {need} as ints or floats")
    elif not _is_rows(matrix):
        raise MisuseError(f"{name} = {matrix!r:.60} ({type(matrix).__name__}) is not a list of rows; {need}")
    if len(matrix) != n:
        raise MisuseError(f"{name} has {len(matrix)} row{'' if len(matrix) == 1 else 's'}; {need}")
    for i, row in enumerate(matrix):
        if not _is_rows(row):
            raise MisuseError(f"{name}[{i}] = {row!r:.60} is not a row; {need}")
        if len(row) != n:
            raise MisuseError(f"{name}[{i}] has {len(row)} entr{'y' if len(row) == 1 else 'ies'}; {need}")
    out = np.empty(n * n)
    for i, row in enumerate(matrix):
        for j, x in enumerate(row):
            out[i * n + j] = _number(x, f"{name}[{i}][{j}]")
    return out


def _values(m, n: int, name: str) -> None:
    """The precise value check, run only when the one-max() test failed: raises at the first bad
    cell (row-major), else the failure was -0.0 (made 0.0 here) or a large diagonal (ignored)."""
    import numpy as np
    off = np.ones(n * n, dtype=bool)
    off[::n + 1] = False
    bad = ~(m >= 0) | np.isinf(m) | (off & (m > _LIMIT))      # ~(m >= 0): negatives and NaN
    if bad.any():
        k = int(bad.argmax())
        i, j = divmod(k, n)
        v = float(m[k])
        cell = f"{name}[{i}][{j}] = {_show(v)}"
        if math.isnan(v):
            raise MisuseError(f"{cell}: every demand must be a finite byte count >= 0; find where the NaN "
                              f"comes from (0/0, inf - inf upstream) and pass 0 for no traffic")
        if v < 0:
            raise MisuseError(f"{cell}: a demand can't be negative (bytes from GPU {i} to GPU {j}); "
                              f"pass 0 for no traffic")
        if math.isinf(v):
            raise MisuseError(f"{cell}: every demand must be a finite byte count; split a huge one, at most "
                              f"2**52 bytes each")
        raise MisuseError(f"{cell} bytes: above 2**52 bytes (where float64 stops holding every whole "
                          f"count); split it before routing")
    m += 0.0                                       # -0.0 -> 0.0


_chain = itertools.chain.from_iterable
_np = None


def demands(matrix, n: int, topo: str, name: str = "matrix"):
    """A traffic matrix checked (see the module docstring) as a flat float64 copy of n*n cells.

    The common case, a list of n lists of n ints/floats, costs one pass of type() over the cells
    and one max() over the converted array's bits on top of the conversion itself (Router.plan's
    hot path: about +1.5 us for 8 x 8 over the bare conversion and clamp it replaces)."""
    global _np
    np = _np
    if np is None:
        import numpy as np
        _np = np
    m = None
    if (type(matrix) is list and len(matrix) == n and all(type(r) is list and len(r) == n for r in matrix)
            and _PLAIN.issuperset(map(type, _chain(matrix)))):
        try:
            m = np.fromiter(_chain(matrix), np.float64, n * n)
        except OverflowError:                      # an int beyond float range: _convert names it
            pass
    if m is None:
        m = _convert(matrix, n, topo, name)
    if m.view(np.uint64).max() > _LIMIT_BITS:
        _values(m, n, name)
    return m


def bool_cells(m, n: int) -> tuple[tuple[int, int], ...]:
    """The cells of a checked matrix (flat m as the router keeps it: floored, diagonal zeroed) that
    hold 0 or 1, the diagonal among them: the only ones where a bool could equal the checked value
    (True == 1, False == 0)."""
    import numpy as np
    return tuple(divmod(k, n) for k in np.flatnonzero(m <= 1.0).tolist())


def has_bool(mt, cells) -> bool:
    """Whether any of those cells of mt (rows of cells) holds a bool."""
    import numpy as np
    kinds = (bool, np.bool_)
    return any(type(mt[i][j]) in kinds for i, j in cells)


def topology(topo, paths: bool = True) -> None:
    """A router Topology: GPU count >= 1, every link capacity finite and > 0, and (paths=True)
    every candidate path between GPUs of the topology over links it has, with finite weights >= 0."""
    name = getattr(topo, "name", "?")
    n = whole(topo.num_gpus, f"topology {name!r}: num_gpus", 1)
    for e, v in topo.capacity.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
            raise MisuseError(f"topology {name!r}: link {e!r} has capacity {v!r} GB/s; capacities must be "
                              f"finite and > 0 (leave out a link that carries nothing)")
    if not paths:
        return
    cap = topo.capacity
    for (s, d), ps in topo.paths.items():
        if not (0 <= s < n and 0 <= d < n):
            raise MisuseError(f"topology {name!r}: paths from GPU {s} to GPU {d}, but its GPUs are 0..{n - 1}; "
                              f"fix num_gpus or the path table")
        for p in ps:
            for e, w in p.links:
                if e not in cap:
                    raise MisuseError(f"topology {name!r}: the {p.name()} path from GPU {s} to GPU {d} crosses "
                                      f"link {e!r}, which has no capacity; add it to topology.capacity")
                if isinstance(w, bool) or not isinstance(w, numbers.Real) or not (math.isfinite(w) and w >= 0):
                    raise MisuseError(f"topology {name!r}: the {p.name()} path from GPU {s} to GPU {d} uses "
                                      f"link {e!r} {w!r} times per byte; a use must be finite and >= 0")
