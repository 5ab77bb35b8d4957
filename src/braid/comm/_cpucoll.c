/* all_reduce, reduce, reduce_scatter, all_to_all and all_gather of CPU tensors through the node
 * segment in native threads (comm/cpushm.py, comm/native_cpu.py). The all_reduce:
 *
 * The tensor is cut into stripes, one per thread of this rank; thread t of every rank works on
 * stripe t and meets only the threads t of the other ranks, through three counters per rank and
 * stripe among the segment's counters (never in the data areas, which other calls write). A
 * stripe goes through in chunks that stay in the CPU's caches between the writer and the
 * readers, SLOTS of them in flight:
 *
 *   1. copy in: each rank writes the parts of the chunk the other ranks reduce into its slot
 *      (its own part stays in its tensor), then raises `in`;
 *   2. reduce: once every rank's `in` reached the chunk, each rank reduces its own part over every
 *      rank in rank order (its own from its tensor), writes the result into its tensor and into
 *      its slot where its own part would be, and raises `red`;
 *   3. copy out: each rank copies every other rank's reduced part from that rank's slot as soon as
 *      that rank's `red` reached the chunk, then raises `out`.
 *
 * A slot is written again only when every rank's `out` passed the chunk that used it last; at the
 * end every stripe waits for every rank's `out`, so the area is free when the call returns. For
 * the ops in BRAID_CPU_LAG a chunk's steps fall in three turns of a rank (run_stripe), so a rank
 * waits only for what its peers did a turn before.
 * Counters are 64-bit: (call's epoch << 32) | chunks done, rising from call to call.
 *
 * A reduce to one root is the same with the root alone writing its tensor: the other ranks write
 * their reduced parts into their slots only, and only the root copies out.
 *
 * The reduce_scatter is steps 1 and 2 with the reduction written to the output alone
 * (run_scatter_stripe); the all_to_all is the same movement with a copy in place of the reduction,
 * the all_gather the same with one chunk per rank that every rank copies out, the broadcast with
 * the root's chunk alone (the root copies in, the others copy out into their tensors). Each element is
 * reduced by one rank in rank order, so every rank ends with the same bits, run after run.
 *
 * A wait spins, then yields the core, then sleeps; while it lasts it looks at every rank's abort
 * word, at the peer's process and at the deadline, and any of them ends the call with a code
 * Python turns into braid's error. A yield that took long says that other threads want the core
 * (other processes busy on the host, more threads than cores): from then on the wait sleeps on
 * the counter (a futex, shared between the processes) and the rank that raises it wakes it, so a
 * waiter no longer takes turns on the core with the rank it waits for (2 ranks on 2 busy cores:
 * a 1 MiB all_reduce took 24 ms against gloo's 4). After BUSY_YIELDS such yields in two calls in a
 * row the waits of the next BUSY_CALLS calls sleep right after their spin, and Python offers larger
 * chunks (fewer hand-offs). Each counter's cache line holds, beside it, the count of threads
 * sleeping on it; a rank that raises a counter nobody sleeps on makes no system call.
 *
 * Build: cc -O3 -march=native -shared -fPIC -pthread (native_cpu.build). */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAXW 64
#define MAXT 32
#define SLOTS 4
#define BLK 1024                /* elements reduced per block (a block's sums stay in registers/L1) */
#define SPIN_NS 20000LL         /* a wait spins this long, then yields the core... */
#define YIELD_NS 5000000LL      /* ...until this long, then sleeps in short steps */
/* per kind of call (bit K_*): chunks a turn apart, copies into the caller's tensors past the caches */
enum { K_ALL_REDUCE = 0, K_REDUCE = 1, K_REDUCE_SCATTER = 2, K_ALL_TO_ALL = 3, K_ALL_GATHER = 4, K_BROADCAST = 5 };
static int lag_kinds = 0, stream_kinds = 0;     /* cpucoll_set_lag, cpucoll_set_stream */
/* kinds of call that run a turn apart with copies past the caches from big_bytes a rank in
 * worlds of big_world ranks and more (cpucoll_set_big) */
static int big_kinds = 0, big_world = 4;
static int64_t big_bytes = 0;
static int64_t slow_yield_ns = 500000;  /* a yield this long: another thread held the core for a
                                          * time slice (0: never; cpucoll_set_slow_yield) */
#define FUTEX_NS 1000000LL      /* longest sleep on a futex between two looks at aborts and peers */
#define BUSY_CALLS 16           /* calls whose waits sleep at once after two calls in a row with... */
#define BUSY_YIELDS 2           /* ...this many slow yields between them (one alone may be noise) */

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the futex waits on a counter's low 32 bits: little-endian only"
#endif
#define CHECK_NS 1000000LL      /* abort words and the deadline: this often while waiting */
#define ALIVE_NS 200000000LL    /* the peer's process: this often */

enum { E_OK = 0, E_TIMEOUT = 1, E_ABORTED = 2, E_DEAD = 3, E_FORKED = 4, E_ARGS = 5, E_MISMATCH = 6, E_LATE = 7 };
#define ROUND_NS 5000000LL      /* cpucoll_call: a header round waits in C this long, then hands over */
enum { DT_F32 = 0, DT_F64 = 1, DT_BF16 = 2, DT_F16 = 3, DT_I32 = 4, DT_I64 = 5 };
enum { OP_SUM = 0, OP_AVG = 1, OP_MIN = 2, OP_MAX = 3, OP_PROD = 4 };
enum { C_IN = 0, C_RED = 1, C_OUT = 2 };

typedef struct {
    uint8_t *buf, *out;         /* reduce_scatter, all_to_all: `buf` the input (world x count), `out` the output */
    int64_t count, chunk;
    int scatter;                /* 0: all_reduce or reduce, 1: reduce_scatter, 2: all_to_all, 3: all_gather,
                                 * 4: broadcast (from root) */
    int root;                   /* a reduce's root; -1: all_reduce */
    int esz, dtype, op, stripes;
    int lag;                    /* turns between a chunk's copy in and its reduction (0 or 1; run_stripe) */
    int stream;                 /* 1: copy_out's stores bypass the caches */
    int dry;                    /* 1: the all_reduce's copies and reductions alone, no counter read or
                                 * written (cpucoll_all_reduce_floor) */
    uint64_t epoch;
    uint64_t stripe_bytes, slot_bytes;
} job_t;

typedef struct ctx ctx_t;
typedef struct { ctx_t *c; int id; } arg_t;

struct ctx {
    int world, me;
    pid_t owner;
    uint8_t *area[MAXW];
    uint8_t *ctrs[MAXW];        /* each rank's counters: MAXT stripes x 3, 64 bytes apart */
    uint64_t area_bytes;
    volatile uint32_t *abort_word[MAXW];
    volatile uint32_t *pid_word[MAXW];
    int64_t timeout_ns;
    /* the pool: workers 1..nworkers run stripes 1..; the caller runs stripe 0 */
    int nworkers;
    pthread_t th[MAXT];
    arg_t args[MAXT];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t gen;               /* raised once per call (atomics) */
    int sleepers, remaining, quit;
    uint64_t busy;              /* slow yields of the last call (atomics; read by cpucoll_busy) */
    uint64_t busy_before;       /* ... and of the call before it */
    int sleepy;                 /* calls left whose waits sleep on the counter after their spin */
    job_t job;
    int fail, fail_peer;
    /* the header round of comm/cpushm.py (cpucoll_call): each rank's header of either parity (8
     * words: round, op, bytes, dtype, detail, the offer's threads, chunk and stripe KiB) and its
     * 32-bit stamp, the next 32 bits the count of its sleepers */
    volatile int64_t *hdr[2][MAXW];
    volatile uint32_t *stamp[MAXW];
    int has_round;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A copy into the caller's own tensor, which no rank reads during the call: with `stream` its
 * stores bypass the caches (no read of the destination's lines first, and the chunks the ranks
 * still read stay cached); the fence orders them before the counter that follows. */
static void copy_out(int stream, uint8_t *dst, const uint8_t *src, size_t n) {
#if defined(__SSE2__)
    if (stream && n >= 1024) {
        size_t head = (size_t)(-(uintptr_t)dst) & 15;
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32)), d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + body, src + body, n - body);
        _mm_sfence();
        return;
    }
#else
    (void)stream;
#endif
    memcpy(dst, src, n);
}

static volatile uint64_t *ctr(ctx_t *c, int r, int t, int kind) {
    return (volatile uint64_t *)(c->ctrs[r] + (uint64_t)(t * 3 + kind) * 64);
}

/* the futex of a shared 32-bit word: sleep while it holds `seen` (at most `ns`), wake every sleeper */
static void futex_wait(volatile uint32_t *w, uint32_t seen, int64_t ns) {
    struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static void futex_wake(volatile uint32_t *w) {
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* the threads (of any rank) asleep on a counter: the next 32 bits of its cache line */
static inline volatile uint32_t *sleepers_of(volatile uint64_t *p) {
    return (volatile uint32_t *)((volatile uint8_t *)p + 8);
}

/* raise a counter, and wake whoever sleeps on it (no system call when nobody does) */
static inline void post(volatile uint64_t *p, uint64_t v) {
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers_of(p), __ATOMIC_SEQ_CST)) futex_wake((volatile uint32_t *)p);
}

/* sleep on a counter until it changes, a wake, or `ns`; the counter's low 32 bits are the word
 * the futex compares (they change at every raise within a call) */
static void sleep_on(volatile uint64_t *p, uint64_t v, int64_t ns) {
    volatile uint32_t *s = sleepers_of(p);
    __atomic_add_fetch(s, 1, __ATOMIC_SEQ_CST);
    uint64_t cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    if (cur < v) futex_wait((volatile uint32_t *)p, (uint32_t)cur, ns);
    __atomic_sub_fetch(s, 1, __ATOMIC_SEQ_CST);
}

static uint8_t *slot(ctx_t *c, int r, int t, int s) {
    return c->area[r] + (uint64_t)t * c->job.stripe_bytes + (uint64_t)s * c->job.slot_bytes;
}

static void set_fail(ctx_t *c, int code, int peer) {
    int zero = 0;
    if (__atomic_compare_exchange_n(&c->fail, &zero, code, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        __atomic_store_n(&c->fail_peer, peer, __ATOMIC_SEQ_CST);
}

/* 1: process `pid` has exited (gone, or a zombie its parent has not reaped) */
static int dead(pid_t pid) {
    if (pid <= 0 || pid == getpid()) return 0;
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char path[64], text[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    char *p = strrchr(text, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

/* a 64-bit counter reached v, or (s32) a 32-bit stamp reached v across wrap-around */
static inline int reached(volatile void *p, uint64_t v, int s32) {
    if (s32) return (uint32_t)(__atomic_load_n((volatile uint32_t *)p, __ATOMIC_ACQUIRE) - (uint32_t)v) < 0x80000000u;
    return __atomic_load_n((volatile uint64_t *)p, __ATOMIC_ACQUIRE) >= v;
}

int cpucoll_sleep32(uint64_t addr, uint32_t v, int64_t ns);

/* until *p reached v (see reached); 0, or -1 when the call failed (here or in another stripe);
 * with `give_up` > 0, 1 once it waited that long (nothing set: the caller goes on elsewhere) */
static int wait_for(ctx_t *c, volatile void *p, uint64_t v, int peer, int s32, int64_t give_up) {
    if (reached(p, v, s32)) return 0;
    int64_t t0 = now_ns(), t = t0, next_check = t0 + CHECK_NS, next_alive = t0 + ALIVE_NS;
    /* a yield took long (here, or BUSY_YIELDS times in a call of the last BUSY_CALLS): other
     * threads want this core, and each further yield would give it away for a time slice */
    int busy = __atomic_load_n(&c->sleepy, __ATOMIC_RELAXED) > 0;
    for (uint64_t i = 1;; i++) {
        if (reached(p, v, s32)) return 0;
        if (__atomic_load_n(&c->fail, __ATOMIC_RELAXED)) return -1;
        if ((i & 31) == 0) t = now_ns();
        if (t - t0 < SPIN_NS) {
            relax();
            continue;
        }
        if (give_up > 0 && t - t0 > give_up) return 1;
        if (busy) {
            if (s32) cpucoll_sleep32((uint64_t)(uintptr_t)p, (uint32_t)v, FUTEX_NS);
            else sleep_on((volatile uint64_t *)p, v, FUTEX_NS);
            t = now_ns();
        } else if (t - t0 < YIELD_NS) {
            int64_t y = t;
            sched_yield();
            t = now_ns();
            busy = slow_yield_ns > 0 && t - y > slow_yield_ns;
            /* the header round's waits (s32) are for the peers' Python, not their data: they
             * sleep for the rest of the wait but leave the call's record alone (its count would
             * put the data's waits to sleep and ask for large chunks) */
            if (busy && !s32) __atomic_add_fetch(&c->busy, 1, __ATOMIC_RELAXED);
        } else {
            struct timespec ts = {0, 100000};
            nanosleep(&ts, NULL);
            t = now_ns();
        }
        if (t >= next_check) {
            next_check = t + CHECK_NS;
            for (int r = 0; r < c->world; r++)
                if (*c->abort_word[r]) { set_fail(c, E_ABORTED, r); return -1; }
            if (t - t0 > c->timeout_ns) { set_fail(c, E_TIMEOUT, peer); return -1; }
        }
        if (t >= next_alive) {
            next_alive = t + ALIVE_NS;
            if (dead((pid_t)*c->pid_word[peer])) {
                if (reached(p, v, s32)) return 0;
                set_fail(c, E_DEAD, peer);
                return -1;
            }
        }
    }
}

static inline int wait_ge(ctx_t *c, volatile uint64_t *p, uint64_t v, int peer) {
    return wait_for(c, p, v, peer, 0, 0);
}

/* reductions: out = src[0] (op) src[1] (op) ... src[n-1], written to d1 and d2 -------------- */
static inline float bf16_to_f(uint16_t h) {
    union { uint32_t u; float f; } x = {(uint32_t)h << 16};
    return x.f;
}

static inline uint16_t f_to_bf16(float f) {
    union { float f; uint32_t u; } x = {f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);    /* NaN stays NaN */
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

#define MINF(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define MAXF(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define MINI(a, b) ((a) < (b) ? (a) : (b))
#define MAXI(a, b) ((a) > (b) ? (a) : (b))

/* a block of floating-point elements: ACC is the accumulator type, LOAD/STORE convert */
#define RED_FLOAT(NAME, T, ACC, LOAD, STORE)                                                        \
static void NAME(uint8_t **src, int n, int64_t m, uint8_t *d1, uint8_t *d2, int op) {              \
    ACC acc[BLK];                                                                                   \
    for (int64_t i0 = 0; i0 < m; i0 += BLK) {                                                       \
        int64_t b = m - i0 < BLK ? m - i0 : BLK;                                                    \
        const T *s0 = (const T *)src[0] + i0;                                                       \
        for (int64_t i = 0; i < b; i++) acc[i] = LOAD(s0[i]);                                       \
        for (int r = 1; r < n; r++) {                                                               \
            const T *s = (const T *)src[r] + i0;                                                    \
            switch (op) {                                                                           \
            case OP_SUM: case OP_AVG: for (int64_t i = 0; i < b; i++) acc[i] += LOAD(s[i]); break;  \
            case OP_MIN: for (int64_t i = 0; i < b; i++) { ACC v = LOAD(s[i]); acc[i] = MINF(acc[i], v); } break; \
            case OP_MAX: for (int64_t i = 0; i < b; i++) { ACC v = LOAD(s[i]); acc[i] = MAXF(acc[i], v); } break; \
            default: for (int64_t i = 0; i < b; i++) acc[i] *= LOAD(s[i]); break;                   \
            }                                                                                       \
        }                                                                                           \
        T *o1 = (T *)d1 + i0;                                                                       \
        if (op == OP_AVG) {     /* as torch: the sum rounded to the type, then divided */           \
            for (int64_t i = 0; i < b; i++) o1[i] = STORE(LOAD(STORE(acc[i])) / (ACC)n);            \
        } else {                                                                                    \
            for (int64_t i = 0; i < b; i++) o1[i] = STORE(acc[i]);                                  \
        }                                                                                           \
        if (d2 != d1) memcpy(d2 + i0 * sizeof(T), o1, b * sizeof(T));                               \
    }                                                                                               \
}

#define ID(x) (x)
RED_FLOAT(red_f32, float, float, ID, ID)
RED_FLOAT(red_f64, double, double, ID, ID)
RED_FLOAT(red_bf16, uint16_t, float, bf16_to_f, f_to_bf16)
#ifdef __FLT16_MAX__
#define H2F(x) ((float)(x))
#define F2H(x) ((_Float16)(x))
RED_FLOAT(red_f16, _Float16, float, H2F, F2H)
#endif

/* integers wrap around (computed unsigned); avg divides truncating toward zero */
#define RED_INT(NAME, T, U)                                                                         \
static void NAME(uint8_t **src, int n, int64_t m, uint8_t *d1, uint8_t *d2, int op) {              \
    T acc[BLK];                                                                                     \
    for (int64_t i0 = 0; i0 < m; i0 += BLK) {                                                       \
        int64_t b = m - i0 < BLK ? m - i0 : BLK;                                                    \
        const T *s0 = (const T *)src[0] + i0;                                                       \
        for (int64_t i = 0; i < b; i++) acc[i] = s0[i];                                             \
        for (int r = 1; r < n; r++) {                                                               \
            const T *s = (const T *)src[r] + i0;                                                    \
            switch (op) {                                                                           \
            case OP_SUM: case OP_AVG: for (int64_t i = 0; i < b; i++) acc[i] = (T)((U)acc[i] + (U)s[i]); break; \
            case OP_MIN: for (int64_t i = 0; i < b; i++) acc[i] = MINI(acc[i], s[i]); break;        \
            case OP_MAX: for (int64_t i = 0; i < b; i++) acc[i] = MAXI(acc[i], s[i]); break;        \
            default: for (int64_t i = 0; i < b; i++) acc[i] = (T)((U)acc[i] * (U)s[i]); break;      \
            }                                                                                       \
        }                                                                                           \
        if (op == OP_AVG) for (int64_t i = 0; i < b; i++) acc[i] = acc[i] / (T)n;                   \
        memcpy(d1 + i0 * sizeof(T), acc, b * sizeof(T));                                            \
        if (d2 != d1) memcpy(d2 + i0 * sizeof(T), acc, b * sizeof(T));                              \
    }                                                                                               \
}

RED_INT(red_i32, int32_t, uint32_t)
RED_INT(red_i64, int64_t, uint64_t)

typedef void (*red_fn)(uint8_t **, int, int64_t, uint8_t *, uint8_t *, int);

static red_fn reducer(int dtype) {
    switch (dtype) {
    case DT_F32: return red_f32;
    case DT_F64: return red_f64;
    case DT_BF16: return red_bf16;
#ifdef __FLT16_MAX__
    case DT_F16: return red_f16;
#endif
    case DT_I32: return red_i32;
    case DT_I64: return red_i64;
    }
    return NULL;
}

/* The floor of one stripe: the copies and reductions of run_stripe's all_reduce, as many bytes
 * each, with no wait and no counter, and every read of a peer's slot made in this rank's own slot
 * instead (the same offsets, kept inside the chunk), so that no byte crosses between cores while
 * every rank runs it at once: what the memory alone takes for the call's bytes, a floor under any
 * call that moves them this way. The values are garbage (the bench's floor, on a scratch tensor). */
static void run_floor(ctx_t *c, int t) {
    job_t *j = &c->job;
    const int n = c->world, me = c->me, esz = j->esz;
    const int64_t lo = j->count * t / j->stripes, hi = j->count * (t + 1) / j->stripes;
    const int64_t chunks = (hi - lo + j->chunk - 1) / j->chunk;
    red_fn red = reducer(j->dtype);
    uint8_t *src[MAXW];
    int64_t bd[MAXW + 1];
    for (int64_t k = 0; k < chunks; k++) {
        const int s = (int)(k % SLOTS);
        const int64_t k0 = lo + k * j->chunk, m = (hi - k0) < j->chunk ? hi - k0 : j->chunk;
        uint8_t *mine = slot(c, me, t, s), *base = j->buf + k0 * esz;
        for (int r = 0; r <= n; r++) bd[r] = m * r / n;
        for (int r = 0; r < n; r++)
            if (r != me) memcpy(mine + bd[r] * esz, base + bd[r] * esz, (bd[r + 1] - bd[r]) * esz);
        const int64_t len = bd[me + 1] - bd[me];
        for (int r = 0; r < n; r++)     /* rank r's part in this rank's slot stands for rank r's slot */
            src[r] = r == me ? base + bd[me] * esz : mine + (bd[r] + len <= m ? bd[r] : m - len) * esz;
        red(src, n, len, base + bd[me] * esz, mine + bd[me] * esz, j->op);
        for (int r = 0; r < n; r++)
            if (r != me) memcpy(base + bd[r] * esz, mine + bd[r] * esz, (bd[r + 1] - bd[r]) * esz);
    }
}

/* one stripe, every chunk (the header comment's steps 1-3) ------------------------------------
 * A chunk's three steps, each a function (nonzero: the call failed). With lag 0 a rank runs the
 * steps of chunk k back to back; with lag 1 its turn i copies chunk i in, reduces chunk i - 1 and
 * copies chunk i - 2 out, so each wait is for a counter the peer raised a turn earlier and a peer
 * that was late by up to a turn holds nobody up. A slot is refilled at turn k + SLOTS once every
 * rank's `out` passed chunk k, raised at that rank's turn k + 2 (SLOTS > 2: no wait of a turn is
 * for a later turn of a peer, whatever lag each rank runs). */
typedef struct {
    int64_t lo, hi, k0, m;
    uint8_t *mine, *base;
    int64_t bd[MAXW + 1];
} piece_t;

static void piece(ctx_t *c, int t, int64_t k, piece_t *p) {
    job_t *j = &c->job;
    const int n = c->world;
    p->lo = j->count * t / j->stripes;
    p->hi = j->count * (t + 1) / j->stripes;
    p->k0 = p->lo + k * j->chunk;
    p->m = (p->hi - p->k0) < j->chunk ? p->hi - p->k0 : j->chunk;
    p->mine = slot(c, c->me, t, (int)(k % SLOTS));
    p->base = j->buf + p->k0 * j->esz;
    for (int r = 0; r <= n; r++) p->bd[r] = p->m * r / n;
}

static int step_in(ctx_t *c, int t, int64_t k, uint64_t E) {
    const int n = c->world, me = c->me, esz = c->job.esz;
    piece_t p;
    piece(c, t, k, &p);
    if (k >= SLOTS)             /* the slot's last chunk is read by every rank */
        for (int r = 0; r < n; r++)
            if (r != me && wait_ge(c, ctr(c, r, t, C_OUT), E | (uint64_t)(k - SLOTS + 1), r)) return -1;
    for (int r = 0; r < n; r++)
        if (r != me) memcpy(p.mine + p.bd[r] * esz, p.base + p.bd[r] * esz, (p.bd[r + 1] - p.bd[r]) * esz);
    post(ctr(c, me, t, C_IN), E | (uint64_t)(k + 1));
    return 0;
}

static int step_reduce(ctx_t *c, int t, int64_t k, uint64_t E) {
    job_t *j = &c->job;
    const int n = c->world, me = c->me, esz = j->esz;
    uint8_t *src[MAXW];
    piece_t p;
    piece(c, t, k, &p);
    for (int r = 0; r < n; r++) {
        if (r == me) { src[r] = p.base + p.bd[me] * esz; continue; }
        if (wait_ge(c, ctr(c, r, t, C_IN), E | (uint64_t)(k + 1), r)) return -1;
        src[r] = slot(c, r, t, (int)(k % SLOTS)) + p.bd[me] * esz;
    }
    /* all_reduce: into the tensor and the slot; a reduce: the root's tensor, another's slot */
    uint8_t *own = p.base + p.bd[me] * esz, *handed = p.mine + p.bd[me] * esz;
    uint8_t *d1 = j->root < 0 || j->root == me ? own : handed, *d2 = j->root < 0 ? handed : d1;
    reducer(j->dtype)(src, n, p.bd[me + 1] - p.bd[me], d1, d2, j->op);
    post(ctr(c, me, t, C_RED), E | (uint64_t)(k + 1));
    return 0;
}

static int step_out(ctx_t *c, int t, int64_t k, uint64_t E) {
    job_t *j = &c->job;
    const int n = c->world, me = c->me, esz = j->esz;
    piece_t p;
    piece(c, t, k, &p);
    for (int i = 1; i < n && (j->root < 0 || j->root == me); i++) {
        int r = (me + i) % n;
        if (wait_ge(c, ctr(c, r, t, C_RED), E | (uint64_t)(k + 1), r)) return -1;
        copy_out(j->stream, p.base + p.bd[r] * esz, slot(c, r, t, (int)(k % SLOTS)) + p.bd[r] * esz, (p.bd[r + 1] - p.bd[r]) * esz);
    }
    post(ctr(c, me, t, C_OUT), E | (uint64_t)(k + 1));
    return 0;
}

static void run_stripe(ctx_t *c, int t) {
    job_t *j = &c->job;
    const int n = c->world, me = c->me, L = j->lag;
    const int64_t lo = j->count * t / j->stripes, hi = j->count * (t + 1) / j->stripes;
    const int64_t chunks = (hi - lo + j->chunk - 1) / j->chunk;
    const uint64_t E = j->epoch << 32;
    for (int64_t i = 0; i < chunks + 2 * L; i++) {
        if (i < chunks && step_in(c, t, i, E)) return;
        if (i - L >= 0 && i - L < chunks && step_reduce(c, t, i - L, E)) return;
        if (i - 2 * L >= 0 && i - 2 * L < chunks && step_out(c, t, i - 2 * L, E)) return;
    }
    for (int r = 0; r < n; r++)     /* nobody reads this rank's area after the call */
        if (r != me && wait_ge(c, ctr(c, r, t, C_OUT), E | (uint64_t)chunks, r)) return;
}

/* reduce_scatter: one stripe of the output's elements. A chunk of L elements is a block of L per
 * destination; each rank writes the blocks of the other destinations into its slot (block d at
 * d * L), raises `in`, reduces its own block over every rank (its own from its input) straight
 * into its output and raises `red`: every rank has read the chunk's slots then. The all_to_all
 * and the all_gather move their chunks the same way and copy where the reduce_scatter reduces.
 * With lag 1 a rank's turn i copies chunk i in and takes chunk i - 1 (as run_stripe's). */
/* chunk k of stripe t: its first element `a` of the count per destination, and its length */
static int64_t span(const job_t *j, int t, int64_t k, int64_t *a) {
    const int64_t hi = j->count * (t + 1) / j->stripes;
    *a = j->count * t / j->stripes + k * j->chunk;
    return (hi - *a) < j->chunk ? hi - *a : j->chunk;
}

static int scatter_in(ctx_t *c, int t, int64_t k, uint64_t E) {
    job_t *j = &c->job;
    const int n = c->world, me = c->me, esz = j->esz;
    const int64_t m = j->count, L = j->chunk;
    int64_t a;
    const int64_t len = span(j, t, k, &a);
    uint8_t *mine = slot(c, me, t, (int)(k % SLOTS));
    if (j->scatter == 4 && j->root != me) {     /* broadcast: only the root writes its slots */
        post(ctr(c, me, t, C_IN), E | (uint64_t)(k + 1));
        return 0;
    }
    if (k >= SLOTS)
        for (int r = 0; r < n; r++)
            if (r != me && wait_ge(c, ctr(c, r, t, C_RED), E | (uint64_t)(k - SLOTS + 1), r)) return -1;
    if (j->scatter >= 3)        /* all_gather, broadcast: this rank's chunk, once for every reader */
        memcpy(mine, j->buf + a * esz, len * esz);
    else
        for (int d = 0; d < n; d++)
            if (d != me) memcpy(mine + d * L * esz, j->buf + (d * m + a) * esz, len * esz);
    post(ctr(c, me, t, C_IN), E | (uint64_t)(k + 1));
    return 0;
}

static int scatter_take(ctx_t *c, int t, int64_t k, uint64_t E) {
    job_t *j = &c->job;
    const int n = c->world, me = c->me, esz = j->esz, s = (int)(k % SLOTS);
    const int64_t m = j->count, L = j->chunk;
    int64_t a;
    const int64_t len = span(j, t, k, &a);
    uint8_t *src[MAXW];
    if (j->scatter == 4) {      /* broadcast: the root's chunk, copied into the tensor (in place) */
        const int r = j->root;
        if (r != me) {
            if (wait_ge(c, ctr(c, r, t, C_IN), E | (uint64_t)(k + 1), r)) return -1;
            copy_out(j->stream, j->out + a * esz, slot(c, r, t, s), len * esz);
        }
    } else if (j->scatter == 3) {      /* all_gather: every rank's chunk, copied into its block */
        memcpy(j->out + (me * m + a) * esz, j->buf + a * esz, len * esz);
        for (int i = 1; i < n; i++) {
            int r = (me + i) % n;
            if (wait_ge(c, ctr(c, r, t, C_IN), E | (uint64_t)(k + 1), r)) return -1;
            copy_out(j->stream, j->out + (r * m + a) * esz, slot(c, r, t, s), len * esz);
        }
    } else if (j->scatter == 2) {   /* all_to_all: every rank's block for this rank, copied */
        memcpy(j->out + (me * m + a) * esz, j->buf + (me * m + a) * esz, len * esz);
        for (int i = 1; i < n; i++) {
            int r = (me + i) % n;
            if (wait_ge(c, ctr(c, r, t, C_IN), E | (uint64_t)(k + 1), r)) return -1;
            copy_out(j->stream, j->out + (r * m + a) * esz, slot(c, r, t, s) + me * L * esz, len * esz);
        }
    } else {
        for (int r = 0; r < n; r++) {
            if (r == me) { src[r] = j->buf + (me * m + a) * esz; continue; }
            if (wait_ge(c, ctr(c, r, t, C_IN), E | (uint64_t)(k + 1), r)) return -1;
            src[r] = slot(c, r, t, s) + me * L * esz;
        }
        reducer(j->dtype)(src, n, len, j->out + a * esz, j->out + a * esz, j->op);
    }
    post(ctr(c, me, t, C_RED), E | (uint64_t)(k + 1));
    return 0;
}

static void run_scatter_stripe(ctx_t *c, int t) {
    job_t *j = &c->job;
    const int n = c->world, me = c->me, lag = j->lag;
    const int64_t m = j->count, lo = m * t / j->stripes, hi = m * (t + 1) / j->stripes;
    const int64_t chunks = (hi - lo + j->chunk - 1) / j->chunk;
    const uint64_t E = j->epoch << 32;
    for (int64_t i = 0; i < chunks + lag; i++) {
        if (i < chunks && scatter_in(c, t, i, E)) return;
        if (i - lag >= 0 && i - lag < chunks && scatter_take(c, t, i - lag, E)) return;
    }
    for (int r = 0; r < n; r++)
        if (r != me && wait_ge(c, ctr(c, r, t, C_RED), E | (uint64_t)chunks, r)) return;
}

static void run(ctx_t *c, int t) {
    if (c->job.dry) run_floor(c, t);
    else if (c->job.scatter) run_scatter_stripe(c, t);
    else run_stripe(c, t);
}

/* the pool ---------------------------------------------------------------------------------- */
static void *worker(void *p) {
    arg_t *a = (arg_t *)p;
    ctx_t *c = a->c;
    uint64_t seen = 0;
    for (;;) {
        int64_t t0 = now_ns();
        uint64_t g;
        while ((g = __atomic_load_n(&c->gen, __ATOMIC_ACQUIRE)) == seen && now_ns() - t0 < 200000LL)
            relax();
        if (g == seen) {
            pthread_mutex_lock(&c->mu);
            c->sleepers++;
            while ((g = __atomic_load_n(&c->gen, __ATOMIC_ACQUIRE)) == seen && !c->quit)
                pthread_cond_wait(&c->cv, &c->mu);
            c->sleepers--;
            pthread_mutex_unlock(&c->mu);
        }
        if (c->quit) return NULL;
        seen = g;
        if (a->id < c->job.stripes) run(c, a->id);
        __atomic_sub_fetch(&c->remaining, 1, __ATOMIC_ACQ_REL);
    }
}

void *cpucoll_new(int world, int me, const uint64_t *areas, const uint64_t *ctrs, uint64_t area_bytes, const uint64_t *abort_words,
                  const uint64_t *pid_words, int64_t timeout_ns, int workers) {
    if (world < 2 || world > MAXW || me < 0 || me >= world || workers < 0 || workers >= MAXT) return NULL;
    ctx_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->world = world;
    c->me = me;
    c->owner = getpid();
    c->area_bytes = area_bytes;
    c->timeout_ns = timeout_ns;
    for (int r = 0; r < world; r++) {
        c->area[r] = (uint8_t *)(uintptr_t)areas[r];
        c->ctrs[r] = (uint8_t *)(uintptr_t)ctrs[r];
        c->abort_word[r] = (volatile uint32_t *)(uintptr_t)abort_words[r];
        c->pid_word[r] = (volatile uint32_t *)(uintptr_t)pid_words[r];
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    for (int i = 1; i <= workers; i++) {
        c->args[i].c = c;
        c->args[i].id = i;
        if (pthread_create(&c->th[i], NULL, worker, &c->args[i]) != 0) break;
        c->nworkers = i;
    }
    return c;
}

int cpucoll_workers(void *h) { return ((ctx_t *)h)->nworkers; }

/* the segment's 32-bit counters, for the rounds in Python (comm/cpushm.py): sleep on one until it
 * reaches v (compared across wrap-around), a wake or `ns`, counting this thread among its sleepers
 * (the next 32 bits); 1 when it reached v */
int cpucoll_sleep32(uint64_t addr, uint32_t v, int64_t ns) {
    volatile uint32_t *p = (volatile uint32_t *)(uintptr_t)addr;
    __atomic_add_fetch(p + 1, 1, __ATOMIC_SEQ_CST);
    uint32_t cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    int reached = (uint32_t)(cur - v) < 0x80000000u;
    if (!reached) {
        futex_wait(p, cur, ns);
        reached = (uint32_t)(__atomic_load_n(p, __ATOMIC_SEQ_CST) - v) < 0x80000000u;
    }
    __atomic_sub_fetch(p + 1, 1, __ATOMIC_SEQ_CST);
    return reached;
}

/* wake every thread asleep on a 32-bit counter (after its owner raised it) */
void cpucoll_wake32(uint64_t addr) { futex_wake((volatile uint32_t *)(uintptr_t)addr); }

/* the yield that says other threads want the core (BRAID_CPU_SLOW_YIELD_US; 0: never) */
void cpucoll_set_slow_yield(int64_t ns) { slow_yield_ns = ns; }

/* the kinds of call (bits 1 << K_*) whose chunks run a turn apart (BRAID_CPU_LAG; see run_stripe) */
void cpucoll_set_lag(int kinds) { lag_kinds = kinds; }

/* the kinds of call whose copies into the caller's tensors bypass the caches (BRAID_CPU_STREAM) */
void cpucoll_set_stream(int kinds) { stream_kinds = kinds; }

/* the kinds of call (bits 1 << K_*) that, from `bytes` a rank (0: never) in worlds of `world`
 * ranks and more, run a turn apart with copies past the caches whatever cpucoll_set_lag and
 * cpucoll_set_stream say (BRAID_CPU_A2A_BIG_MB) */
void cpucoll_set_big(int kinds, int64_t bytes, int world) { big_kinds = kinds; big_bytes = bytes; big_world = world; }

/* how the last call ran: bit 0 a turn apart, bit 1 copies past the caches */
int cpucoll_last_mode(void *h) { const job_t *j = &((ctx_t *)h)->job; return j->lag | j->stream << 1; }

/* the last call's slow yields (waits that found their core wanted) */
uint64_t cpucoll_busy(void *h) { return __atomic_load_n(&((ctx_t *)h)->busy, __ATOMIC_RELAXED); }

int cpucoll_has_f16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

/* one call of either op on every stripe: the caller runs stripe 0, the pool the others */
static int go(ctx_t *c, void *buf, void *out, int64_t count, int esz, int dtype, int op, uint64_t epoch, int stripes,
              int64_t chunk, int scatter, int root, int *peer, int dry) {
    *peer = -1;
    if (getpid() != c->owner) return E_FORKED;
    if (!dry) {                 /* the floor waits for nobody: it leaves the waits' record alone */
        if (c->sleepy > 0) c->sleepy--;
        c->busy_before = __atomic_exchange_n(&c->busy, 0, __ATOMIC_RELAXED);
    }
    if (stripes < 1) stripes = 1;
    if (stripes > c->nworkers + 1) stripes = c->nworkers + 1;
    job_t *j = &c->job;
    j->buf = (uint8_t *)buf;
    j->out = (uint8_t *)out;
    j->scatter = scatter;
    j->dry = dry;
    const int kind = scatter ? scatter + 1 : root >= 0 && root < c->world ? K_REDUCE : K_ALL_REDUCE;
    j->lag = (lag_kinds >> kind) & 1;
    j->stream = (stream_kinds >> kind) & 1;
    /* a rank's bytes: an all_to_all's count is per destination block */
    if (((big_kinds >> kind) & 1) && big_bytes > 0 && c->world >= big_world
        && count * esz * (scatter == 2 ? c->world : 1) >= big_bytes)
        j->lag = j->stream = 1;
    j->root = root < 0 || root >= c->world ? -1 : root;
    if (scatter == 4 && j->root < 0) return E_ARGS;
    j->count = count;
    j->esz = esz;
    j->dtype = dtype;
    j->op = op;
    j->stripes = stripes;
    j->epoch = epoch & 0xffffffffu;
    j->stripe_bytes = (c->area_bytes / stripes) & ~(uint64_t)63;
    j->slot_bytes = (j->stripe_bytes / SLOTS) & ~(uint64_t)63;
    int64_t fit = (int64_t)(j->slot_bytes / esz / (scatter == 1 || scatter == 2 ? c->world : 1));
    j->chunk = chunk < fit ? chunk : fit;
    if (j->chunk < 1) return E_ARGS;
    c->fail = 0;
    c->fail_peer = -1;
    if (stripes > 1) {
        __atomic_store_n(&c->remaining, c->nworkers, __ATOMIC_RELEASE);
        __atomic_add_fetch(&c->gen, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_lock(&c->mu);
        if (c->sleepers) pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    run(c, 0);
    if (stripes > 1) {
        int64_t t0 = now_ns();
        while (__atomic_load_n(&c->remaining, __ATOMIC_ACQUIRE) > 0) {
            if (now_ns() - t0 < SPIN_NS) relax(); else sched_yield();
        }
    }
    if (!dry && __atomic_load_n(&c->busy, __ATOMIC_RELAXED) + c->busy_before >= BUSY_YIELDS) c->sleepy = BUSY_CALLS;
    *peer = c->fail_peer;
    return c->fail;
}

/* The header round of comm/cpushm.py (CpuShm._round), in C: this rank's header of the round's
 * parity (round `seq`, then `words`: op, bytes, dtype, detail, the offer's threads, chunk KiB and
 * stripe KiB), its stamp raised to the round (its sleepers woken), every peer's stamp awaited, the
 * headers' words 1-4 compared, and the least offer of every rank into `least`. A rank running
 * the round in Python meets this one alike. 0; E_MISMATCH (a peer's header differs: Python names
 * the calls), E_LATE (a peer's stamp did not come within ROUND_NS: the round is left for Python
 * to finish, with the waits that tell a peer's other call from a slow peer), or a failure. */
static int round_in(ctx_t *c, uint64_t seq, const int64_t *words, int64_t *least, int *peer) {
    const int n = c->world, me = c->me, p = (int)(seq & 1);
    const uint32_t s = (uint32_t)seq;
    volatile int64_t *h = c->hdr[p][me];
    h[0] = (int64_t)seq;
    for (int i = 0; i < 7; i++) h[1 + i] = words[i];
    volatile uint32_t *st = c->stamp[me];
    __atomic_store_n(st, s, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(st + 1, __ATOMIC_SEQ_CST)) futex_wake(st);
    int far = 0;
    for (int r = 0; r < n; r++) {
        if (r == me) continue;
        int w = wait_for(c, c->stamp[r], s, r, 1, ROUND_NS);
        if (w) {
            *peer = w > 0 ? r : c->fail_peer;
            return w > 0 ? E_LATE : c->fail;
        }
        far |= (uint32_t)(__atomic_load_n(c->stamp[r], __ATOMIC_ACQUIRE) - s) > 1;
    }
    if (far)    /* a peer is at most one round ahead, unless it aborted (all its counters jump) */
        for (int r = 0; r < n; r++)
            if (*c->abort_word[r]) { *peer = r; return E_ABORTED; }
    for (int i = 0; i < 3; i++) least[i] = words[4 + i];
    for (int r = 0; r < n; r++) {
        volatile int64_t *o = c->hdr[p][r];
        if (o[1] != words[0] || o[2] != words[1] || o[3] != words[2] || o[4] != words[3]) {
            *peer = r;
            return E_MISMATCH;
        }
        for (int i = 0; i < 3; i++) if (o[5 + i] < least[i]) least[i] = o[5 + i];
    }
    return E_OK;
}

/* the header round's places in the segment: each rank's header of parity 0 and 1, and its stamp */
int cpucoll_set_round(void *h, const uint64_t *hdr0, const uint64_t *hdr1, const uint64_t *stamps) {
    ctx_t *c = (ctx_t *)h;
    for (int r = 0; r < c->world; r++) {
        c->hdr[0][r] = (volatile int64_t *)(uintptr_t)hdr0[r];
        c->hdr[1][r] = (volatile int64_t *)(uintptr_t)hdr1[r];
        c->stamp[r] = (volatile uint32_t *)(uintptr_t)stamps[r];
    }
    c->has_round = 1;
    return E_OK;
}

/* One whole native call with its header round in C (round_in): `what` 0 an all_reduce (root < 0)
 * or a reduce, 1 a reduce_scatter, 2 an all_to_all, 3 an all_gather, 4 a broadcast from `root`,
 * with the arguments of its cpucoll_* entry below. The stripes and the chunk come from the least offer, as the Python
 * round's caller makes them (cpushm._cut): stripes = threads, fewer where a thread would get less
 * than the stripe KiB of `per` bytes; chunk = chunk KiB in elements of `esz`, divided by `div`,
 * at least `least_chunk`. On E_LATE nothing but the round's own writes happened. */
int cpucoll_call(void *h, int what, void *buf, void *out, int64_t count, int esz, int dtype, int op, int root,
                 uint64_t seq, const int64_t *words, int64_t per, int div, int64_t least_chunk, int *peer) {
    ctx_t *c = (ctx_t *)h;
    int64_t least[3] = {1, 1, 1};
    *peer = -1;
    if (getpid() != c->owner) return E_FORKED;
    if (!c->has_round || div < 1 || esz < 1 || what < 0 || what > 4) return E_ARGS;
    c->fail = 0;
    c->fail_peer = -1;
    int rc = round_in(c, seq, words, least, peer);
    if (rc) return rc;
    const int64_t threads = least[0], chunk_kb = least[1], stripe_kb = least[2] > 1 ? least[2] : 1;
    int64_t stripes = per / (stripe_kb << 10);
    if (stripes > threads) stripes = threads;
    if (stripes < 1) stripes = 1;
    int64_t chunk = ((chunk_kb << 10) / esz) / div;
    if (chunk < least_chunk) chunk = least_chunk;
    if (chunk < 1) chunk = 1;
    if (what >= 2) esz = 1, dtype = DT_F32, op = OP_SUM;    /* all_to_all, all_gather, broadcast move bytes */
    return go(c, buf, what == 0 || what == 4 ? buf : out, count, esz, dtype, op, seq, (int)stripes, chunk, what,
              what == 0 || what == 4 ? root : -1, peer, 0);
}

/* The whole all_reduce of `count` elements at `buf`, in place (root < 0), or a reduce into the
 * root's `buf` (the others' stay as they were). Returns E_OK or the failure's code (its rank in
 * *peer). The stripes' count and the chunk are the same on every rank (Python agrees on them in
 * the call's header round). */
int cpucoll_all_reduce(void *h, void *buf, int64_t count, int esz, int dtype, int op, uint64_t epoch, int stripes,
                       int64_t chunk, int root, int *peer) {
    return go((ctx_t *)h, buf, buf, count, esz, dtype, op, epoch, stripes, chunk, 0, root, peer, 0);
}

/* The floor of an all_reduce of `count` elements at `buf` (a scratch tensor: it ends with garbage):
 * this rank's copies and reductions of the call with these stripes and chunk, with no wait (see
 * run_floor). Every rank runs it at once for the bench's measured ceiling. */
int cpucoll_all_reduce_floor(void *h, void *buf, int64_t count, int esz, int dtype, int op, int stripes, int64_t chunk) {
    int peer;
    return go((ctx_t *)h, buf, buf, count, esz, dtype, op, 0, stripes, chunk, 0, -1, &peer, 1);
}

/* The whole all_to_all of `inp` (world blocks of `count` bytes, block d to rank d) into `out`
 * (world blocks, block r from rank r), as cpucoll_all_reduce; `chunk` is bytes per block. */
int cpucoll_all_to_all(void *h, void *out, void *inp, int64_t count, uint64_t epoch, int stripes, int64_t chunk,
                       int *peer) {
    return go((ctx_t *)h, inp, out, count, 1, DT_F32, OP_SUM, epoch, stripes, chunk, 2, -1, peer, 0);
}

/* The whole all_gather of `inp` (`count` bytes) into `out` (world blocks, block r from rank r), as
 * cpucoll_all_reduce; `chunk` is bytes. */
int cpucoll_all_gather(void *h, void *out, void *inp, int64_t count, uint64_t epoch, int stripes, int64_t chunk,
                       int *peer) {
    return go((ctx_t *)h, inp, out, count, 1, DT_F32, OP_SUM, epoch, stripes, chunk, 3, -1, peer, 0);
}

/* The whole broadcast of `count` bytes at `buf` from rank `root` (in place), as
 * cpucoll_all_reduce; `chunk` is bytes. */
int cpucoll_broadcast(void *h, void *buf, int64_t count, int root, uint64_t epoch, int stripes, int64_t chunk,
                      int *peer) {
    return go((ctx_t *)h, buf, buf, count, 1, DT_F32, OP_SUM, epoch, stripes, chunk, 4, root, peer, 0);
}

/* The whole reduce_scatter of `inp` (world x count elements) into `out` (count elements), as
 * cpucoll_all_reduce; `chunk` is elements per destination block. */
int cpucoll_reduce_scatter(void *h, void *out, void *inp, int64_t count, int esz, int dtype, int op, uint64_t epoch,
                           int stripes, int64_t chunk, int *peer) {
    return go((ctx_t *)h, inp, out, count, esz, dtype, op, epoch, stripes, chunk, 1, -1, peer, 0);
}

/* A small call's reduction on the caller's thread: out = rows[0] (op) ... rows[n-1] in rank order
 * (torch's own reduction there starts its thread pool, whose threads then spin beside the other
 * ranks: 8 ranks on 16 vCPUs, 2026-11-27, 16-32 KiB all_reduces took 0.7-1.6 ms instead of ~0.1). */
int cpucoll_reduce_rows(const uint64_t *rows, int n, int64_t m, void *out, int dtype, int op) {
    red_fn red = reducer(dtype);
    uint8_t *src[MAXW];
    if (!red || n < 1 || n > MAXW) return E_ARGS;
    for (int r = 0; r < n; r++) src[r] = (uint8_t *)(uintptr_t)rows[r];
    red(src, n, m, (uint8_t *)out, (uint8_t *)out, op);
    return E_OK;
}

void cpucoll_free(void *h) {
    ctx_t *c = (ctx_t *)h;
    if (!c) return;
    if (getpid() == c->owner) {
        pthread_mutex_lock(&c->mu);
        c->quit = 1;
        __atomic_add_fetch(&c->gen, 1, __ATOMIC_SEQ_CST);
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        for (int i = 1; i <= c->nworkers; i++) pthread_join(c->th[i], NULL);
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->cv);
    }
    free(c);
}
