"""Probe only, never for real jobs: with BRAID_PROBE_NOROUND=1 a repeated prepared call whose own
word matches its program posts the word and launches without reading the peers' words (no host wait
for the peer). Safe only where no peer's buffers change between calls (a training job's steady
state, which the bench's bitwise check against NCCL confirms). It measures what a call that never
waits for the peer on the host would give a job: the GPU-side word check's upper bound.

    PYTHONPATH=scripts/probes/noround BRAID_PROBE_NOROUND=1 python3 -m braid bench --workload ddp \
        --nproc 2 --shares ce=1
"""
import atexit
import os
import sys

if os.environ.get("BRAID_PROBE_NOROUND") == "1":
    try:
        from braid.comm import callpath
        from braid.comm.prepared import NO_OBS
    except ImportError:                 # not braid's process
        callpath = None
    if callpath is not None:
        _orig = callpath.CallPath.fast_prepared
        _count = [0, 0]                 # taken without the round, handed to braid's own path

        def _fast_prepared(self, tkey, inp, outs, async_op, redo=None):
            prep = self.prepared
            tk = prep.tickets.get(tkey)
            if (tk is None or not prep.enabled or self.faults.closed or self.faults.aborted
                    or tk.bal != self.policy.balancer.version or self.pending
                    or (self.policy.pending and tk.op in self.policy.pending)
                    or not tk.entry.exec_ptr or prep.entries.get(tk.key) is not tk.entry
                    or callpath._capturing()):
                _count[1] += 1
                return _orig(self, tkey, inp, outs, async_op, redo)
            word = prep.finish_word(tk.base, inp, tk.lanes)
            if word != tk.key[self.rank]:
                _count[1] += 1
                return _orig(self, tkey, inp, outs, async_op, redo)
            self.ledger.ncalls += 1
            self.segment.post_values([word, *NO_OBS])
            prep.get(tk.key)                # (prep.launch counts the replay)
            self.ledger.last_call = tk.ledger
            handle = prep.launch(tk.entry, self.ce.stream, async_op, (inp, *outs))
            self.ledger.last_handle = handle
            _count[0] += 1
            return handle

        callpath.CallPath.fast_prepared = _fast_prepared
        atexit.register(lambda: _count[0] and print(f"noround probe pid {os.getpid()}: {_count[0]} calls without "
                                                    f"the round, {_count[1]} on braid's path", file=sys.stderr))
