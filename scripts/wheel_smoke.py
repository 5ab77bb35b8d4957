"""Checks of braid as installed from its wheel (scripts/wheel_smoke.sh runs both steps).

    python3 wheel_smoke.py contents DIST_DIR SRC_DIR
        the sdist and the wheel in DIST_DIR hold every file of the package under SRC_DIR (each
        module and data file), the wheel's metadata names braid-collectives at braid's version,
        and the console script `braid`. Any Python 3.11+; no torch needed.
    python3 wheel_smoke.py run
        with the venv's Python, from a folder outside the checkout: braid comes from the venv, its
        metadata and version agree, `braid --version`, `braid env`, `braid sim` on its presets and
        its recorded bench, and a 2-rank CPU world under init_process_group("braid") (all_reduce
        and all_gather, small calls that gloo takes whole and large ones split over braid's lanes)
        with results checked exactly.

Exits non-zero with a line saying what failed.
"""
from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import tarfile
import time
import zipfile


def fail(msg: str) -> None:
    print(f"wheel smoke: FAIL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def say(msg: str) -> None:
    print(f"wheel smoke: {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# contents: the built files against the source tree
# ---------------------------------------------------------------------------------------------

def package_files(src: pathlib.Path) -> set[str]:
    """Every file of the package under src/braid (modules and data), as paths from src/."""
    out = set()
    for f in (src / "braid").rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
            out.add(f.relative_to(src).as_posix())
    return out


def read_version(src: pathlib.Path) -> str:
    m = re.search(r'^__version__ = "([^"]+)"$', (src / "braid" / "_version.py").read_text(), re.M)
    if not m:
        fail(f"no __version__ in {src / 'braid' / '_version.py'}")
    return m.group(1)


def contents(dist: pathlib.Path, src: pathlib.Path) -> None:
    version = read_version(src)
    want = package_files(src)
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(f"expected one wheel and one sdist in {dist}, found {[p.name for p in dist.iterdir()]}")
    wheel, sdist = wheels[0], sdists[0]
    if not wheel.name.startswith(f"braid_collectives-{version}-py3-none-any"):
        fail(f"wheel {wheel.name}: expected braid_collectives-{version}-py3-none-any.whl")
    if sdist.name != f"braid_collectives-{version}.tar.gz":
        fail(f"sdist {sdist.name}: expected braid_collectives-{version}.tar.gz")

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"braid_collectives-{version}.dist-info"
        meta = z.read(f"{info}/METADATA").decode()
        entry = z.read(f"{info}/entry_points.txt").decode()
    lacking = sorted(want - names)
    if lacking:
        fail(f"the wheel lacks {len(lacking)} file(s) of the package: {lacking[:20]}")
    extra_top = sorted({n.split("/")[0] for n in names} - {"braid", info})
    if extra_top:
        fail(f"the wheel installs more than the braid package: {extra_top}")
    for line in ("Name: braid-collectives", f"Version: {version}", "Provides-Extra: bench"):
        if line not in meta.splitlines():
            fail(f"the wheel's METADATA has no line {line!r}")
    if not re.search(r"^braid = braid\.__main__:main$", entry, re.M):
        fail(f"the wheel's entry points have no console script braid: {entry!r}")

    with tarfile.open(sdist) as t:
        root = f"braid_collectives-{version}/"
        snames = {m.name[len(root):] for m in t.getmembers() if m.name.startswith(root)}
    lacking = sorted(f"src/{n}" for n in want if f"src/{n}" not in snames)
    for need in ("pyproject.toml", "README.md"):
        if need not in snames:
            lacking.append(need)
    if lacking:
        fail(f"the sdist lacks {len(lacking)} file(s): {lacking[:20]}")
    say(f"{wheel.name} and {sdist.name} hold all {len(want)} files of the package "
        f"({sum(1 for n in want if not n.endswith('.py'))} data files)")


# ---------------------------------------------------------------------------------------------
# run: the installed package, away from the checkout
# ---------------------------------------------------------------------------------------------

SMALL, LARGE = 1000, 1 << 20      # float32 elements: 4 KB (gloo whole) and 4 MiB (split over lanes)


def _rank(rank: int, world: int, port: int, q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        import warnings
        warnings.filterwarnings("ignore", message=".* is deprecated", category=FutureWarning)  # torch 2.13's
        import torch
        import torch.distributed as dist
        import braid
        dist.init_process_group("braid", rank=rank, world_size=world)
        assert dist.get_backend() == "braid", dist.get_backend()
        for n in (SMALL, LARGE):
            x = torch.arange(n, dtype=torch.float32) * (rank + 1)
            dist.all_reduce(x)
            want = torch.arange(n, dtype=torch.float32) * sum(r + 1 for r in range(world))
            assert torch.equal(x, want), f"all_reduce of {n}: wrong result"
            mine = torch.full((n,), float(rank + 1))
            out = torch.empty(world * n)
            dist.all_gather_into_tensor(out, mine)
            assert torch.equal(out, torch.cat([torch.full((n,), float(r + 1)) for r in range(world)])), \
                f"all_gather_into_tensor of {n}: wrong result"
            outs = [torch.empty(n) for _ in range(world)]
            dist.all_gather(outs, mine)
            assert all(torch.equal(o, torch.full((n,), float(r + 1))) for r, o in enumerate(outs)), \
                f"all_gather of {n}: wrong result"
        comm = braid.init()
        lanes = sorted(comm.lanes_for(torch.device("cpu")))
        split = getattr(getattr(comm, "_prepared", None), "stats", {}).get("built", "?")
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, "ok", f"lanes {lanes}, {split} split call shapes"))
    except BaseException as exc:      # report, then let the parent fail
        import traceback
        q.put((rank, "error", f"{exc!r}\n{traceback.format_exc()}"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks() -> None:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world, port = 2, _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, q)) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < world:
            left = 120 - (time.monotonic() - t0)
            if left <= 0:
                fail(f"the 2-rank world did not finish in 120 s (reports: {got})")
            try:
                rank, status, detail = q.get(timeout=min(left, 5))
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    fail(f"a rank died: exit codes {[p.exitcode for p in procs]} (reports: {got})")
                continue
            got[rank] = (status, detail)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    bad = {r: d for r, (s, d) in got.items() if s != "ok"}
    if bad:
        fail(f"2-rank world under init_process_group('braid'): {bad}")
    say(f"2 CPU ranks under init_process_group('braid'): all_reduce, all_gather_into_tensor, all_gather of "
        f"{SMALL} and {LARGE} float32 exact; {got[0][1]} ({time.monotonic() - t0:.1f} s)")


def run() -> None:
    prefix = pathlib.Path(sys.prefix).resolve()
    here = pathlib.Path.cwd().resolve()
    import importlib.metadata as md
    import braid
    where = pathlib.Path(braid.__file__).resolve()
    if prefix not in where.parents:
        fail(f"braid was imported from {where}, not from this environment ({prefix})")
    for p in [here, *here.parents]:
        if (p / "pyproject.toml").exists() or (p / "src" / "braid").is_dir():
            fail(f"run from inside a checkout ({p}); the smoke test runs from a folder outside it")
    dist_version = md.version("braid-collectives")
    if dist_version != braid.__version__:
        fail(f"installed metadata says {dist_version}, braid.__version__ is {braid.__version__}")
    say(f"import braid {braid.__version__} from {where.parent}")

    exe = prefix / "bin" / "braid"
    if not exe.exists():
        fail(f"no console script {exe}")
    env = dict(os.environ)
    cmds = {
        "braid --version": [str(exe), "--version"],
        "braid env": [str(exe), "env"],
        "braid sim presets": [str(exe), "sim", "presets"],
        "braid sim reproduce flexlink": [str(exe), "sim", "reproduce", "flexlink"],
        "braid sim own": [str(exe), "sim", "own"],
    }
    procs = {k: subprocess.Popen(v, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for k, v in cmds.items()}
    out = {}
    for k, p in procs.items():
        o, e = p.communicate(timeout=180)
        if p.returncode != 0:
            fail(f"`{k}` exited {p.returncode}: {(e or o)[-2000:]}")
        out[k] = o
    checks = {
        "braid --version": lambda o: o.startswith(f"braid {braid.__version__} (braid-collectives; "),
        "braid env": lambda o: "BRAID_PREPARED" in o and "BRAID_SHARED_GPU" in o,
        "braid sim presets": lambda o: all(f"## {n}:" in o for n in (
            "h200x2", "h200x4", "h800x8-flexlink", "hopper8-8nic-fuselink", "h100x4-mesh-4rail-nimble")),
        "braid sim reproduce flexlink": lambda o: "preset h800x8-flexlink" in o and " yes" in o,
        "braid sim own": lambda o: "h200x2-all_gather-256M" in o,
    }
    for k, ok in checks.items():
        if not ok(out[k]):
            fail(f"`{k}` printed something unexpected:\n{out[k][:1500]}")
    say(out["braid --version"].strip())
    say(f"braid env: {sum(1 for line in out['braid env'].splitlines() if line.startswith('BRAID_'))} settings")
    say(f"braid sim presets: {out['braid sim presets'].count(chr(10) + '## ') + out['braid sim presets'].startswith('## ')} "
        f"presets; sim reproduce flexlink: {out['braid sim reproduce flexlink'].count(' yes')} figures within "
        f"tolerance; sim own: {sum(1 for line in out['braid sim own'].splitlines() if line.startswith('h200'))} points")
    two_ranks()
    say("passed")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "contents":
        contents(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))
    elif len(sys.argv) == 2 and sys.argv[1] == "run":
        run()
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
