/* The launcher of deferred prepared calls (comm/rounds.py, comm/native_rounds.py): a native thread
 * that waits for every rank's word of a call in the node segment, checks the words against the
 * ones the prepared program was built for and, when they match, makes the lane stream wait for the
 * caller's start event, launches the program and raises the end counter on that stream. It never
 * takes Python's interpreter lock. Anything else (a word that differs, a peer that is late beyond
 * `handoff_ns`, a driver error) is handed back to Python, which runs the job itself; the thread
 * then waits until Python says it is done. Jobs run in the order they were pushed.
 *
 * Build: cc -O2 -shared -fPIC -pthread (native_rounds.build). No CUDA headers: the driver's
 * functions come in as pointers. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAXW 64
#define RING 64
/* A wait spins this long before it yields, and yields this long before it sleeps: a sleep or a
 * condition variable's wake-up costs ~60-80 us on the GPU machines' VMs, more than a call's launch. */
#define SPIN_NS 100000LL
#define YIELD_NS 2000000LL

typedef int (*wait_event_fn)(void *stream, void *event, unsigned flags);
typedef int (*graph_launch_fn)(void *exec, void *stream);
typedef int (*write_value_fn)(void *stream, uint64_t addr, uint32_t value, unsigned flags);
typedef int (*set_ctx_fn)(void *ctx);

typedef struct {
    uint32_t seq, n, slot;      /* the round's sequence number; the end counter's value; its slot */
    uint64_t expect[MAXW];      /* every rank's word the program was built for */
    void *start, *exec;
    int64_t t_push;             /* when it was pushed (CLOCK_MONOTONIC ns) */
} job_t;

typedef struct {
    int world, me, nslots, nvals;
    volatile uint32_t *ctr[MAXW];   /* each rank's collective mailbox counter */
    uint8_t *slots[MAXW];           /* each rank's first collective slot */
    uint64_t slot_bytes;
    void *stream, *ctx;
    uint64_t end_addr;
    wait_event_fn wait_event;
    graph_launch_fn graph_launch;
    write_value_fn write_value;
    set_ctx_fn set_ctx;
    int64_t handoff_ns;
    job_t ring[RING];
    uint64_t pushed, done;          /* jobs pushed, jobs finished (by this thread or by Python) */
    uint64_t py_until;              /* jobs before this one go to Python undecided (rounds_handback) */
    int handed;                     /* 1: the job at `done` waits for Python (reason in `why`) */
    int why;                        /* 1 words differ, 2 peer late, 3 driver error (rc in `rc`) */
    int rc;
    int stop;
    int64_t launch_ns;              /* summed over the jobs this thread launched: push to launch */
    pthread_mutex_t mu;
    pthread_cond_t cv;              /* a push, a stop, Python's answer */
    pthread_cond_t py;              /* a hand-over or a finished job, for Python's waiter */
    pthread_t thread;
    int started;
} rounds_t;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

/* One step of a wait that began at t0: spin, then yield, then a short sleep. */
static void backoff(int64_t t0, int64_t now) {
    if (now - t0 < SPIN_NS) {
        for (int i = 0; i < 64; i++) relax();
    } else if (now - t0 < YIELD_NS) {
        sched_yield();
    } else {
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

/* Spin and yield (not sleep) while *word == was, up to YIELD_NS; without the lock. */
static void linger(volatile uint64_t *word, uint64_t was, volatile int *stop) {
    int64_t t0 = now_ns(), t = t0;
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == was && !*stop && t - t0 < YIELD_NS) {
        backoff(t0, t);
        t = now_ns();
    }
}

static int reached(volatile uint32_t *ctr, uint32_t seq) {
    return (int32_t)(*ctr - seq) >= 0;      /* wrap-aware, as the segment's counters compare */
}

/* 0: every peer posted `seq`; 2: one is still missing after handoff_ns. */
static int await_round(rounds_t *r, uint32_t seq) {
    int64_t t0 = now_ns(), t_end = t0 + r->handoff_ns;
    for (int p = 0; p < r->world; p++) {
        if (p == r->me) continue;
        while (!reached(r->ctr[p], seq)) {
            int64_t t = now_ns();
            if (t > t_end || r->stop) return 2;
            backoff(t0, t);
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return 0;
}

/* Did every rank post `nvals` values whose first is its word in `expect`, in slot k? */
static int slots_match(uint8_t *const *slots, uint64_t slot_bytes, int world, uint64_t k, int nvals,
                       const uint64_t *expect) {
    for (int p = 0; p < world; p++) {
        const uint8_t *slot = slots[p] + k * slot_bytes;
        uint32_t count;
        uint64_t word;
        memcpy(&count, slot, 4);
        memcpy(&word, slot + 4, 8);
        if ((int)count != nvals || word != expect[p]) return 0;
    }
    return 1;
}

static int words_match(rounds_t *r, const job_t *j) {
    return slots_match(r->slots, r->slot_bytes, r->world, j->slot % (uint64_t)r->nslots, r->nvals, j->expect);
}

static void *run(void *arg) {
    rounds_t *r = (rounds_t *)arg;
    int ctx_ok = r->set_ctx == NULL || r->set_ctx(r->ctx) == 0;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        if (!r->stop && r->done == r->pushed && !r->handed) {
            /* nothing queued: the next push usually comes within a call's host time */
            uint64_t was = r->pushed;
            pthread_mutex_unlock(&r->mu);
            linger(&r->pushed, was, &r->stop);
            pthread_mutex_lock(&r->mu);
        }
        while (!r->stop && (r->done == r->pushed || r->handed)) pthread_cond_wait(&r->cv, &r->mu);
        if (r->stop) break;
        uint64_t idx = r->done;
        job_t j = r->ring[idx % RING];
        pthread_mutex_unlock(&r->mu);
        int why = idx < r->py_until ? 4 : await_round(r, j.seq);
        int rc = 0;
        int64_t launched = 0;
        if (!why && !words_match(r, &j)) why = 1;
        if (!why && !ctx_ok) { why = 3; rc = -1; }
        if (!why) {
            rc = r->wait_event(r->stream, j.start, 0);
            if (!rc) rc = r->graph_launch(j.exec, r->stream);
            launched = now_ns();
            if (!rc) rc = r->write_value(r->stream, r->end_addr, j.n, 0);
            if (rc) why = 3;
        }
        pthread_mutex_lock(&r->mu);
        if (r->done != idx) {
            /* cleared meanwhile (rounds_clear): the job is no longer ours */
        } else if (why) {
            r->handed = 1;
            r->why = why;
            r->rc = rc;
        } else {
            r->done++;
            r->launch_ns += launched - j.t_push;
        }
        pthread_cond_broadcast(&r->py);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* Each rank's collective counter and first slot, from their addresses in this process. */
static void map_round(volatile uint32_t **ctr, uint8_t **slots, int world, const uint64_t *ctr_addrs,
                      const uint64_t *slot_addrs) {
    for (int p = 0; p < world; p++) {
        ctr[p] = (volatile uint32_t *)(uintptr_t)ctr_addrs[p];
        slots[p] = (uint8_t *)(uintptr_t)slot_addrs[p];
    }
}

rounds_t *rounds_new(int world, int me, int nslots, int nvals, uint64_t slot_bytes, const uint64_t *ctr_addrs,
                     const uint64_t *slot_addrs, void *stream, void *ctx, uint64_t end_addr, void *wait_event,
                     void *graph_launch, void *write_value, void *set_ctx, int64_t handoff_ns) {
    if (world < 1 || world > MAXW) return NULL;
    rounds_t *r = calloc(1, sizeof(rounds_t));
    if (!r) return NULL;
    r->world = world; r->me = me; r->nslots = nslots; r->nvals = nvals; r->slot_bytes = slot_bytes;
    map_round(r->ctr, r->slots, world, ctr_addrs, slot_addrs);
    r->stream = stream; r->ctx = ctx; r->end_addr = end_addr;
    r->wait_event = (wait_event_fn)wait_event;
    r->graph_launch = (graph_launch_fn)graph_launch;
    r->write_value = (write_value_fn)write_value;
    r->set_ctx = (set_ctx_fn)set_ctx;
    r->handoff_ns = handoff_ns;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    pthread_cond_init(&r->py, NULL);
    if (pthread_create(&r->thread, NULL, run, r) != 0) {
        free(r);
        return NULL;
    }
    r->started = 1;
    return r;
}

/* 0, or -1 when RING jobs are unfinished (the caller keeps fewer queued than that). */
int rounds_push(rounds_t *r, uint32_t seq, uint32_t slot, uint32_t n, const uint64_t *expect, void *start,
                void *exec) {
    pthread_mutex_lock(&r->mu);
    if (r->pushed - r->done >= RING) {
        pthread_mutex_unlock(&r->mu);
        return -1;
    }
    job_t *j = &r->ring[r->pushed % RING];
    j->seq = seq; j->slot = slot; j->n = n; j->start = start; j->exec = exec; j->t_push = now_ns();
    memcpy(j->expect, expect, sizeof(uint64_t) * (size_t)r->world);
    r->pushed++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* Jobs finished so far; when the next one was handed to Python, *why (1 words, 2 late, 3 driver
 * error, *rc its code, 4 handed back undecided), else *why = 0. Waits up to timeout_ns first while
 * nothing was handed over and `seen` jobs are finished (seen = HANDED_ONLY: whatever finished);
 * called without the interpreter lock. *launch_ns: the launched jobs' summed push-to-launch time. */
#define HANDED_ONLY UINT64_MAX
uint64_t rounds_poll(rounds_t *r, uint64_t seen, int64_t timeout_ns, int *why, int *rc, int64_t *launch_ns) {
    pthread_mutex_lock(&r->mu);
    if (timeout_ns > 0 && seen != HANDED_ONLY && r->done == seen && !r->handed && !r->stop) {
        /* a caller waiting for room: the next job ends within a launch, sooner than a wake-up */
        pthread_mutex_unlock(&r->mu);
        linger(&r->done, seen, &r->stop);
        pthread_mutex_lock(&r->mu);
    }
    if (timeout_ns > 0 && (seen == HANDED_ONLY || r->done == seen) && !r->handed && !r->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = ts.tv_nsec + timeout_ns;
        ts.tv_sec += ns / 1000000000LL;
        ts.tv_nsec = ns % 1000000000LL;
        pthread_cond_timedwait(&r->py, &r->mu, &ts);
    }
    uint64_t done = r->done;
    *why = r->handed ? r->why : 0;
    *rc = r->rc;
    *launch_ns = r->launch_ns;
    pthread_mutex_unlock(&r->mu);
    return done;
}

/* Python ran the handed-over job: the thread goes on with the next. */
void rounds_resume(rounds_t *r) {
    pthread_mutex_lock(&r->mu);
    if (r->handed) {
        r->handed = 0;
        r->done++;
    }
    pthread_cond_broadcast(&r->cv);
    pthread_cond_broadcast(&r->py);
    pthread_mutex_unlock(&r->mu);
}

/* Every job pushed so far and not finished goes to Python undecided (why 4): a rebuild changed
 * the prepared calls' cache, which the words pushed with them do not know about. */
void rounds_handback(rounds_t *r) {
    pthread_mutex_lock(&r->mu);
    r->py_until = r->pushed;
    pthread_mutex_unlock(&r->mu);
}

/* Drop every unfinished job (after an error Python raises; their ends are released by Python). */
void rounds_clear(rounds_t *r) {
    pthread_mutex_lock(&r->mu);
    r->handed = 0;
    r->done = r->pushed;
    pthread_cond_broadcast(&r->py);
    pthread_mutex_unlock(&r->mu);
}

void rounds_free(rounds_t *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_cond_broadcast(&r->py);
    pthread_mutex_unlock(&r->mu);
    if (r->started) pthread_join(r->thread, NULL);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    pthread_cond_destroy(&r->py);
    free(r);
}

/* ---------------------------------------------------------------------------------------------
 * The caller's own repeated call (comm/exchange.py Exchange._fast_prepared, native_rounds.FastCalls):
 * what the Python fast path of a prepared call on the copy engines does between the op's checks and
 * its handle, in one call without the interpreter lock: the capture check, the word (with the id of
 * the input's allocation), its post in the node segment, the read and compare of every rank's word,
 * and on a hit the launch on the caller's stream or, forked, on the lane stream with its end event.
 * Anything else goes back to Python, which goes on from where this stopped (the round posted or not,
 * as the code says). */

typedef int (*ptr_attr_fn)(void *data, int attr, uint64_t ptr);
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*is_capturing_fn)(void *stream, int *status);

typedef int (*memcpy_fn)(uint64_t dst, uint64_t src, size_t n, void *stream);
typedef int (*wait_value_fn)(void *stream, uint64_t addr, uint32_t value, unsigned flags);
typedef int (*batch_fn)(void *stream, unsigned count, void *ops, unsigned flags);

#define BUFFER_ID_ATTR 7            /* CU_POINTER_ATTRIBUTE_BUFFER_ID */

typedef struct {
    int world, me, nslots, nvals;
    volatile uint32_t *ctr[MAXW];   /* each rank's collective mailbox counter */
    uint8_t *slots[MAXW];           /* each rank's first collective slot */
    uint64_t slot_bytes;
    ptr_attr_fn ptr_attr;
    event_record_fn event_record;
    wait_event_fn wait_event;
    graph_launch_fn graph_launch;
    is_capturing_fn is_capturing;
    memcpy_fn memcpy_async;         /* uneven_post's (fast_set_post) */
    wait_value_fn wait_value, write_value;
    batch_fn batch;
} fast_t;

/* One call shape (a Ticket), filled by Python once; native_rounds.TicketC mirrors it. */
typedef struct {
    uint64_t base;                  /* the word's base: this rank's facts of the call */
    void *exec, *stream, *start;    /* the program, the lane stream, the fork's event */
    uint64_t expect[MAXW];          /* every rank's word the program was built for */
} ticket_t;

/* The word from its base and the id of the input's allocation (0: none); prepared.mix_word is the
 * same function in Python, which the full path uses. */
uint64_t mix_word(uint64_t base, uint64_t id) {
    if (!id) return base & 0x7FFFFFFFFFFFFFFFULL;
    uint64_t h = base ^ (id * 0x9E3779B97F4A7C15ULL);
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 29;
    return h & 0x7FFFFFFFFFFFFFFFULL;
}

fast_t *fast_new(int world, int me, int nslots, int nvals, uint64_t slot_bytes, const uint64_t *ctr_addrs,
                 const uint64_t *slot_addrs, void *ptr_attr, void *event_record, void *wait_event, void *graph_launch,
                 void *is_capturing) {
    if (world < 1 || world > MAXW || nvals < 1) return NULL;
    fast_t *f = calloc(1, sizeof(fast_t));
    if (!f) return NULL;
    f->world = world; f->me = me; f->nslots = nslots; f->nvals = nvals; f->slot_bytes = slot_bytes;
    map_round(f->ctr, f->slots, world, ctr_addrs, slot_addrs);
    f->ptr_attr = (ptr_attr_fn)ptr_attr;
    f->event_record = (event_record_fn)event_record;
    f->wait_event = (wait_event_fn)wait_event;
    f->graph_launch = (graph_launch_fn)graph_launch;
    f->is_capturing = (is_capturing_fn)is_capturing;
    return f;
}

void fast_free(fast_t *f) { free(f); }

/* Raise this rank's counter to `seq` (its slot written), then spin until every other rank's has
 * reached it: 1, or 0 when one has not within spin_ns. */
static int post_and_spin(fast_t *f, uint32_t seq, int64_t spin_ns) {
    __atomic_store_n(f->ctr[f->me], seq, __ATOMIC_RELEASE);
    int64_t t0 = now_ns();
    for (int p = 0; p < f->world; p++) {
        if (p == f->me) continue;
        while (!reached(f->ctr[p], seq)) {
            if (now_ns() - t0 > spin_ns) return 0;
            for (int i = 0; i < 16; i++) relax();
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return 1;
}

/* What fast_call returns. */
#define FAST_HIT 0          /* every word matched; launched */
#define FAST_DIFF 1         /* posted; a word (or a count) differs: Python reads the round */
#define FAST_LATE 2         /* posted; a peer has not posted within spin_ns: Python reads (and waits) */
#define FAST_ID_ERR 3       /* nothing posted: the allocation id's driver call failed (*rc) */
#define FAST_CAPTURING 4    /* nothing posted: the caller's stream is capturing (or the check failed) */
#define FAST_LAUNCH_ERR 5   /* posted and matched; a driver call of the launch failed (*rc) */

/* One repeated call of `t` as round `seq` of the segment. inp: the input's address where its
 * allocation's id goes into the word, else 0. mode 0: launch on `caller`; 1: fork onto the lane
 * stream, launch, record `end` there and make `caller` wait for it; 2: the same without the wait
 * (async). *word: the word posted; *round_ns: post to the last peer's word read.
 * `vals` NULL: the round of a call's word alone (the word, then nothing observed; only the words
 * are compared). Else the round another agreement shapes (an all_to_all whose split sizes are all
 * equal: comm/uneven.py): `n` values as `vals` holds them, but for the word at `wpos` and, at
 * `ipos` (-1: none), the input's own word (mix_word of its address and its allocation's id,
 * never 0: a2av.word_of); it matches where every rank posted `n` values, its word the ticket's
 * and every other value but the one at `ipos` equal to this rank's. */
static int fast_round(fast_t *f, const ticket_t *t, uint32_t seq, uint64_t inp, void *caller, void *end, int mode,
                      int64_t spin_ns, const uint64_t *vals, int n, int wpos, int ipos, uint64_t *word, int *rc,
                      int64_t *round_ns) {
    int status = 0;
    *rc = 0;
    if (f->is_capturing(caller, &status) != 0 || status != 0) return FAST_CAPTURING;
    uint64_t id = 0;
    if (inp) {
        int e = f->ptr_attr(&id, BUFFER_ID_ATTR, inp);
        if (e) { *rc = e; return FAST_ID_ERR; }
    }
    uint64_t w = mix_word(t->base, id);
    *word = w;
    /* the post: the count and the values, then this rank's counter */
    uint64_t k = seq % (uint64_t)f->nslots;
    uint8_t *mine = f->slots[f->me] + k * f->slot_bytes;
    uint32_t cnt = (uint32_t)n;
    memcpy(mine, &cnt, 4);
    if (vals == NULL) {
        memcpy(mine + 4, &w, 8);
        memset(mine + 12, 0, 8 * (size_t)(n - 1));
    } else {
        memcpy(mine + 4, vals, 8 * (size_t)n);
        memcpy(mine + 4 + 8 * (size_t)wpos, &w, 8);
        if (ipos >= 0) {
            uint64_t iw = mix_word(inp, id) | 1;
            memcpy(mine + 4 + 8 * (size_t)ipos, &iw, 8);
        }
    }
    int64_t t0 = now_ns();
    if (!post_and_spin(f, seq, spin_ns)) return FAST_LATE;
    *round_ns = now_ns() - t0;
    if (vals == NULL) {
        if (!slots_match(f->slots, f->slot_bytes, f->world, k, n, t->expect)) return FAST_DIFF;
    } else {
        for (int p = 0; p < f->world; p++) {
            const uint8_t *slot = f->slots[p] + k * f->slot_bytes;
            uint32_t c;
            memcpy(&c, slot, 4);
            if ((int)c != n) return FAST_DIFF;
            for (int i = 0; i < n; i++) {
                uint64_t v;
                if (i == ipos) continue;
                memcpy(&v, slot + 4 + 8 * (size_t)i, 8);
                if (v != (i == wpos ? t->expect[p] : vals[i])) return FAST_DIFF;
            }
        }
    }
    int e;
    if (mode == 0) {
        e = f->graph_launch(t->exec, caller);
    } else {
        e = f->event_record(t->start, caller);
        if (!e) e = f->wait_event(t->stream, t->start, 0);
        if (!e) e = f->graph_launch(t->exec, t->stream);
        if (!e) e = f->event_record(end, t->stream);
        if (!e && mode == 1) e = f->wait_event(caller, end, 0);
    }
    if (e) { *rc = e; return FAST_LAUNCH_ERR; }
    return FAST_HIT;
}

int fast_call(fast_t *f, const ticket_t *t, uint32_t seq, uint64_t inp, void *caller, void *end, int mode,
              int64_t spin_ns, uint64_t *word, int *rc, int64_t *round_ns) {
    return fast_round(f, t, seq, inp, caller, end, mode, spin_ns, NULL, f->nvals, 0, -1, word, rc, round_ns);
}

/* fast_call in the round of `n` values `vals` (fast_round); -1: n is not a round's size here. */
int fast_call_vals(fast_t *f, const ticket_t *t, uint32_t seq, uint64_t inp, void *caller, void *end, int mode,
                   int64_t spin_ns, const uint64_t *vals, int n, int wpos, int ipos, uint64_t *word, int *rc,
                   int64_t *round_ns) {
    if (n < 1 || 4 + 8 * (uint64_t)n > f->slot_bytes || wpos < 0 || wpos >= n || ipos >= n) return -1;
    return fast_round(f, t, seq, inp, caller, end, mode, spin_ns, vals, n, wpos, ipos, word, rc, round_ns);
}

/* ---------------------------------------------------------------------------------------------
 * An uneven all_to_all's posting on the copy engines (comm/a2av.py UnevenCe.run), once its round
 * was read and its verdict is theirs: the matrix comes from that round's slots, the same values
 * Python read; the driver calls are the ones the Python posting makes, in its order:
 *
 *   fork      event_record(start, caller); wait_event(lane, start)
 *   pulls     for each source s with bytes for me, in the order me+1, me+2, ...: (the first with
 *             my ready before it, one batch) wait for s's ready; copy s's part for me into my output
 *   end       my done and the wait for every reader's done (one batch); my own part on the caller
 *   join      event_record(end, lane); synchronous: wait_event(caller, end)
 *
 * Counters as lanes/signals.py Rising: ready is ce_arrive[me] = seq, done ce_finish[me] = seq, the
 * waits are >= (cyclic). A batch of one operation, or batching off (BRAID_CE_BATCH=0), goes as
 * single writes and waits, as _cuda.memops does. Returns 0, or what went wrong: UP_COUNT (a slot
 * holds another count of values), UP_NOPEER (a source with bytes for me has no mapped input),
 * UP_DRIVER (a driver call failed: its code in *rc; what was posted before it stays posted). */

/* CUstreamBatchMemOpParams as _cuda.MemOp lays it out (48 bytes) */
typedef struct {
    uint32_t operation, pad0;
    uint64_t address, value;
    uint32_t flags, pad1;
    uint64_t alias, pad2;
} memop_t;

#define OP_WAIT32 1                 /* CU_STREAM_MEM_OP_WAIT_VALUE_32 */
#define OP_WRITE32 2                /* CU_STREAM_MEM_OP_WRITE_VALUE_32 */
#define UP_COUNT 1
#define UP_NOPEER 2
#define UP_DRIVER 3

/* The driver functions of uneven_post (its copies and memory operations); batch NULL: single
 * operations only (BRAID_CE_BATCH=0). */
void fast_set_post(fast_t *f, void *memcpy_async, void *wait_value, void *write_value, void *batch) {
    f->memcpy_async = (memcpy_fn)memcpy_async;
    f->wait_value = (wait_value_fn)wait_value;
    f->write_value = (wait_value_fn)write_value;
    f->batch = (batch_fn)batch;
}

static void op_set(memop_t *m, int wait, uint64_t addr, uint32_t value) {
    memset(m, 0, sizeof *m);
    m->operation = wait ? OP_WAIT32 : OP_WRITE32;
    m->address = addr;
    m->value = value;               /* flags 0: a wait is >= (cyclic), a write the default */
}

static int ops_post(const fast_t *f, void *stream, memop_t *ops, int n) {
    if (n == 0) return 0;
    if (n == 1 || f->batch == NULL) {
        for (int i = 0; i < n; i++) {
            wait_value_fn fn = ops[i].operation == OP_WAIT32 ? f->wait_value : f->write_value;
            int e = fn(stream, ops[i].address, (uint32_t)ops[i].value, 0);
            if (e) return e;
        }
        return 0;
    }
    return f->batch(stream, (unsigned)n, ops, 0);
}

/* seq: the round's sequence number; n: its count of values; roff: where each rank's row starts
 * among them; peers[s]: rank s's mapped input (0: none); arrive[r], finish[r]: the device
 * addresses of rank r's ce_arrive and ce_finish counters; cseq: the call's counter value. */
int uneven_post(fast_t *f, uint32_t seq, int n, int roff, const uint64_t *peers, const uint64_t *arrive,
                const uint64_t *finish, uint32_t cseq, uint64_t inp, uint64_t out, void *caller, void *lane,
                void *start, void *end, int sync, int *rc) {
    const int w = f->world, me = f->me;
    const uint64_t k = seq % (uint64_t)f->nslots;
    uint64_t m[MAXW][MAXW];
    memop_t ops[2 * MAXW + 2];
    *rc = 0;
    if (roff < 0 || roff + w > n || 4 + 8 * (uint64_t)n > f->slot_bytes || !f->memcpy_async || !f->wait_value
        || !f->write_value)
        return UP_COUNT;
    for (int p = 0; p < w; p++) {
        const uint8_t *slot = f->slots[p] + k * f->slot_bytes;
        uint32_t c;
        memcpy(&c, slot, 4);
        if ((int)c != n) return UP_COUNT;
        memcpy(m[p], slot + 4 + 8 * (size_t)roff, 8 * (size_t)w);
    }
    uint64_t out_at[MAXW], at = 0;
    for (int s = 0; s < w; s++) { out_at[s] = at; at += m[s][me]; }
    for (int i = 1; i < w; i++) {
        int s = (me + i) % w;
        if (m[s][me] && !peers[s]) return UP_NOPEER;
    }
    int e = f->event_record(start, caller);
    if (!e) e = f->wait_event(lane, start, 0);
    int nops = 0, first = 1;
    op_set(&ops[nops++], 0, arrive[me], cseq);          /* my ready: with the first wait, or alone */
    for (int i = 1; i < w && !e; i++) {
        int s = (me + i) % w;
        if (!m[s][me]) continue;
        if (!first) nops = 0;
        first = 0;
        op_set(&ops[nops++], 1, arrive[s], cseq);
        e = ops_post(f, lane, ops, nops);
        uint64_t off = 0;                                 /* where my part sits in s's input */
        for (int d = 0; d < me; d++) off += m[s][d];
        if (!e) e = f->memcpy_async(out + out_at[s], peers[s] + off, (size_t)m[s][me], lane);
    }
    if (!e && first) e = ops_post(f, lane, ops, 1);          /* no sources: my ready alone */
    if (!e) {
        nops = 0;
        op_set(&ops[nops++], 0, finish[me], cseq);
        for (int d = 0; d < w; d++)
            if (d != me && m[me][d]) op_set(&ops[nops++], 1, finish[d], cseq);
        e = ops_post(f, lane, ops, nops);
    }
    if (!e && m[me][me]) {
        uint64_t off = 0;
        for (int d = 0; d < me; d++) off += m[me][d];
        e = f->memcpy_async(out + out_at[me], inp + off, (size_t)m[me][me], caller);
    }
    if (!e) e = f->event_record(end, lane);
    if (!e && sync) e = f->wait_event(caller, end, 0);
    if (e) { *rc = e; return UP_DRIVER; }
    return 0;
}

/* An uneven all_to_all's round (comm/uneven.py UnevenAgreement.round) in one call: this rank's `n`
 * values posted as round `seq` (at `ipos`, unless -1, the input's word: mix_word of its address
 * and its allocation's id, | 1, as a2av.word_of makes it), then every rank's read once each posted
 * within spin_ns, and the checks that need no decision: every count n, one agreement value (at 2),
 * one pair hash (at n - 2), and what each rank sends me (its row at ROW_AT, column me) equal to
 * `recv`. Where they hold, out[] gets the largest demand (max of every rank's value 0), the
 * matrix's size (its largest row or column sum), 1 where every entry is the same and above 0, and
 * every rank's input word (value 1), and it returns UR_OK; Python's verdict goes on from those.
 * UR_LATE (a peer not there yet) and UR_DIFF (a check failed): posted, Python reads the round
 * (read_values waits, raises or decides as without this call). UR_ID_ERR: nothing posted. */
#define UR_OK 0
#define UR_DIFF 1
#define UR_LATE 2
#define UR_ID_ERR 3
#define ROW_AT 3

int uneven_round(fast_t *f, uint32_t seq, const uint64_t *vals, int n, int ipos, uint64_t inp, const uint64_t *recv,
                 int64_t spin_ns, uint64_t *out, int *rc) {
    const int w = f->world, me = f->me;
    *rc = 0;
    if (n < ROW_AT + w + 2 || n > 2 * MAXW + 8 || 4 + 8 * (uint64_t)n > f->slot_bytes || ipos >= n) return UR_DIFF;
    uint64_t iw = 0;
    if (ipos >= 0) {
        uint64_t id = 0;
        int e = f->ptr_attr(&id, BUFFER_ID_ATTR, inp);
        if (e) { *rc = e; return UR_ID_ERR; }
        iw = mix_word(inp, id) | 1;
    }
    const uint64_t k = seq % (uint64_t)f->nslots;
    uint8_t *mine = f->slots[me] + k * f->slot_bytes;
    uint32_t cnt = (uint32_t)n;
    memcpy(mine, &cnt, 4);
    memcpy(mine + 4, vals, 8 * (size_t)n);
    if (ipos >= 0) memcpy(mine + 4 + 8 * (size_t)ipos, &iw, 8);
    if (!post_and_spin(f, seq, spin_ns)) return UR_LATE;
    uint64_t v[MAXW][2 * MAXW + 8], first = 0;
    for (int p = 0; p < w; p++) {
        const uint8_t *slot = f->slots[p] + k * f->slot_bytes;
        uint32_t c;
        memcpy(&c, slot, 4);
        if ((int)c != n) return UR_DIFF;
        memcpy(v[p], slot + 4, 8 * (size_t)n);
        if (p == 0) first = v[0][ROW_AT];
    }
    uint64_t big = 0, size = 0;
    int even = first > 0;
    for (int p = 0; p < w; p++) {
        if (v[p][2] != v[0][2] || v[p][n - 2] != v[0][n - 2] || v[p][ROW_AT + me] != recv[p]) return UR_DIFF;
        if (v[p][0] > big) big = v[p][0];
        uint64_t row = 0, col = 0;
        for (int d = 0; d < w; d++) {
            row += v[p][ROW_AT + d];
            col += v[d][ROW_AT + p];
            if (v[p][ROW_AT + d] != first) even = 0;
        }
        if (row > size) size = row;
        if (col > size) size = col;
        out[3 + p] = v[p][1];
    }
    out[0] = big;
    out[1] = size;
    out[2] = (uint64_t)even;
    return UR_OK;
}
