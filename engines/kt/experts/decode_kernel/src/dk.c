/* The decode kernel's dispatcher: ISA choice, layers, the worker pool and the phases of a call.
 * Built without ISA flags; avx512vnni.c, avx512.c, avx2vnni.c and avx2.c hold the vector code, one half
 * chosen once at run time from what cpuid reports.
 *
 * A call runs three phases on every worker, separated by barriers:
 *   0  the rows' activations into the form the ISA's dot products read (float in their order, or int8 groups)
 *   1  gate/up + SwiGLU: items are (expert, 16 intermediate rows; 32 where the half quantizes gate's / up's
 *      or down's activations, so that an item ends with a whole group of the down projection's input), from a
 *      shared counter; the SwiGLU output is written in the form the down projection's format reads
 *   2  down: items are (expert, 32 hidden rows), each expert's output kept per (row, slot)
 *   3  the weighted sum over each row's slots in slot order, split over hidden columns
 * Which worker computes an item never changes what it computes, so results do not depend on the thread
 * count, and a row's results do not depend on the other rows of the call. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>
#include "dk.h"

#define DOWN_ROWS 32
#define SUM_COLS 256
#define MAX_R 256 /* rows one ISA call takes (isa_impl.h: MAXR) */

float dk_e8m0[256]; /* 2^(e - 127), filled once by choose_isa */

/* ------------------------------------------------------------------------------------------ ISA */
static const dk_isa_ops *chosen;
static int chosen_isa;

static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* the halves, best first; a CPU runs the first one it has */
static const struct {
    const char *name;
    const dk_isa_ops *ops;
    int isa;
} HALVES[] = {
    {"avx512-vnni", &dk_ops_avx512_vnni, DK_ISA_AVX512_VNNI},
    {"avx512", &dk_ops_avx512, DK_ISA_AVX512},
    {"avx2-vnni", &dk_ops_avx2_vnni, DK_ISA_AVX2_VNNI},
    {"avx2", &dk_ops_avx2, DK_ISA_AVX2},
};
#define HALF_COUNT 4

static int cpu_has_half(int i) {
    switch (i) {
    case 0: return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
    case 1: return cpu_has_avx512();
    case 2: return cpu_has_avx2() && __builtin_cpu_supports("avxvnni");
    case 3: return cpu_has_avx2();
    default: return 0;
    }
}

static void choose_isa(void) {
    if (chosen_isa) return;
    for (int e = 0; e < 256; e++) dk_e8m0[e] = ldexpf(1.f, e - 127);
    /* KTSERVE_DECODE_KERNEL_ISA names the best half to use (a lesser one where the CPU lacks it), or none */
    const char *want = getenv("KTSERVE_DECODE_KERNEL_ISA");
    int first = 0;
    if (want && !strcmp(want, "none")) first = HALF_COUNT;
    for (int i = 0; want && i < HALF_COUNT; i++)
        if (!strcmp(want, HALVES[i].name)) first = i;
    chosen_isa = -1;
    for (int i = first; i < HALF_COUNT; i++)
        if (cpu_has_half(i)) {
            chosen = HALVES[i].ops;
            chosen_isa = HALVES[i].isa;
            break;
        }
}

/* DK_ISA_*, or 0 where this CPU has no half (or KTSERVE_DECODE_KERNEL_ISA=none) */
int dk_isa(void) {
    choose_isa();
    return chosen_isa > 0 ? chosen_isa : 0;
}

const char *dk_isa_name(void) { return dk_isa() ? chosen->name : "none"; }

/* Switch to the half `name` ("avx512-vnni", "avx512", "avx2-vnni", "avx2") where this CPU has it, for tests of
 * each in one process; only while no call runs. Returns the ISA now chosen (0: none, the choice unchanged). */
int dk_force_isa(const char *name) {
    choose_isa();
    for (int i = 0; i < HALF_COUNT; i++)
        if (!strcmp(name, HALVES[i].name) && cpu_has_half(i)) {
            chosen = HALVES[i].ops;
            chosen_isa = HALVES[i].isa;
            return chosen_isa;
        }
    return 0;
}

/* In how many int8 passes the chosen half takes the activations of format fmt: 1 for INT4 / Q8_0 / Q4_0 / Q4_K /
 * Q6_K on the integer path, 2 for MXFP4 there (isa_impl.h: two_pass), 0 where it computes in float; -1 without
 * a half */
int dk_activation_passes(int fmt) { return dk_isa() ? chosen->activation_passes(fmt) : -1; }

/* ------------------------------------------------------------------------------------------ layers */
static int dup_ptrs(dk_mat *m, const int64_t *w, const int64_t *s, int experts, int rows, int cols) {
    m->w = malloc(sizeof(void *) * experts);
    m->s = malloc(sizeof(void *) * experts);
    if (!m->w || !m->s) return -1;
    for (int e = 0; e < experts; e++) {
        m->w[e] = (const uint8_t *)(intptr_t)w[e];
        m->s[e] = (const void *)(intptr_t)s[e];
    }
    m->rows = rows;
    m->cols = cols;
    return 0;
}

/* the FP8 projections' multipliers (gate and up where fmt is FP8, down where down_fmt is) */
static int own_fp8_scales(dk_layer *L) {
    dk_mat *mats[3] = {&L->gate, &L->up, &L->down};
    int fp8[3] = {L->fmt == DK_FP8, L->fmt == DK_FP8, L->down_fmt == DK_FP8};
    size_t total = 0;
    for (int i = 0; i < 3; i++)
        if (fp8[i]) total += (size_t)((mats[i]->rows + 127) / 128) * ((mats[i]->cols + 127) / 128);
    if (!total) return 0;
    L->fp8_scales = malloc(sizeof(float) * total * L->experts);
    if (!L->fp8_scales) return -1;
    float *p = L->fp8_scales;
    for (int i = 0; i < 3; i++) {
        if (!fp8[i]) continue;
        size_t n = (size_t)((mats[i]->rows + 127) / 128) * ((mats[i]->cols + 127) / 128);
        for (int e = 0; e < L->experts; e++) {
            const float *src = mats[i]->s[e];
            for (size_t j = 0; j < n; j++) {
                p[j] = src[j] * 256.f;
                if (!isfinite(p[j])) return -2;
            }
            mats[i]->s[e] = p;
            p += n;
        }
    }
    return 0;
}

void dk_layer_destroy(dk_layer *L) {
    if (!L) return;
    dk_mat *mats[3] = {&L->gate, &L->up, &L->down};
    for (int i = 0; i < 3; i++) { free(mats[i]->w); free(mats[i]->s); }
    free(L->fp8_scales);
    free(L);
}

static int valid_format(int fmt) { return fmt >= DK_MXFP4 && fmt <= DK_LAST_FORMAT; }

/* columns a row of the format must be a multiple of: ggml's super-blocks (Q4_K, Q6_K) are 256 wide */
static int cols_multiple(int fmt) { return fmt == DK_Q4_K || fmt == DK_Q6_K ? 256 : 32; }

/* ptrs: 6 arrays of `experts` addresses, gate w/s, up w/s, down w/s (dk.h says what each holds; they are read
 * in place for as long as the layer lives); gate and up in format fmt, down in down_fmt. NULL on a bad
 * argument (a size that is not a multiple of its format's block width among them). */
dk_layer *dk_layer_create_mixed(int fmt, int down_fmt, int experts, int hidden, int inter, const int64_t *ptrs,
                                float limit) {
    if (!valid_format(fmt) || !valid_format(down_fmt) || experts < 1 || hidden < 32 || inter < 32 ||
        hidden % cols_multiple(fmt) || inter % cols_multiple(down_fmt) || hidden % 32 || inter % 32)
        return NULL;
    dk_layer *L = calloc(1, sizeof *L);
    if (!L) return NULL;
    L->fmt = fmt; L->down_fmt = down_fmt; L->experts = experts; L->hidden = hidden; L->inter = inter;
    L->limit = limit;
    int bad = dup_ptrs(&L->gate, ptrs, ptrs + experts, experts, inter, hidden) ||
              dup_ptrs(&L->up, ptrs + 2 * experts, ptrs + 3 * experts, experts, inter, hidden) ||
              dup_ptrs(&L->down, ptrs + 4 * experts, ptrs + 5 * experts, experts, hidden, inter);
    if (!bad) bad = own_fp8_scales(L);
    if (bad) { dk_layer_destroy(L); return NULL; }
    return L;
}

/* a layer whose three projections are all of format fmt */
dk_layer *dk_layer_create(int fmt, int experts, int hidden, int inter, const int64_t *ptrs, float limit) {
    return dk_layer_create_mixed(fmt, fmt, experts, hidden, inter, ptrs, limit);
}

/* ------------------------------------------------------------------------------------------ calls */
typedef struct dk_call {
    const dk_layer *L;
    int tokens, top_k, x_bf16, out_bf16;
    const void *x;
    const int64_t *ids;
    const float *weights;
    void *out;
    /* the grouping: experts used, in first-use order, and per expert its (row, slot) pairs */
    int used;
    int *expert;     /* [used] */
    int *pair_start; /* [used + 1] into pair_row / pair_slot */
    int *pair_row, *pair_slot;
    int *pair_of;    /* [tokens * top_k]: the pair index of (row, slot), -1 none */
    uint8_t *xf;     /* [tokens] activation rows in the ISA's form, x_stride bytes each */
    uint8_t *h;      /* [pairs] SwiGLU outputs in the ISA's form, h_stride bytes each */
    size_t x_stride, h_stride;
    float *y;        /* [pairs, hidden] */
    atomic_int next[4];
    atomic_int *done; /* a stream task's done cell, set to 1 when the call ends (NULL: none) */
} dk_call;

typedef struct dk_task dk_task;
#define DK_BELLS 8            /* doorbell cells a pool watches: one per CUDA stream that starts its tasks */
#define DK_TASK_PAGE 256
#define DK_TASK_PAGES 256     /* task ids 1 .. DK_TASK_PAGE * DK_TASK_PAGES - 1 */

typedef struct dk_pool {
    int threads;
    pthread_t *tid;
    atomic_uint generation; /* bumped to start a call; workers sleep on it when idle */
    atomic_int stop;
    atomic_int arrived[4];  /* barrier counts, one per phase end */
    atomic_int finished;
    atomic_int busy;        /* a call is running */
    dk_call call;
    size_t cap_pairs, cap_x, cap_h, cap_y; /* grown, never shrunk */
    long spin_ns;
    int *cpus;
    /* stream tasks started through host memory (dk_pool_watch): the doorbells the streams write task ids into,
     * the watcher thread that reads them, and the tasks by id */
    atomic_int *bells;
    int watching;
    pthread_t watcher;
    pthread_mutex_t ids_lock;
    _Atomic(dk_task *) *task_pages[DK_TASK_PAGES];
    int *free_ids, n_free, next_id;
} dk_pool;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void futex_wait(atomic_uint *addr, unsigned expected) {
    syscall(SYS_futex, (unsigned *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(atomic_uint *addr) { syscall(SYS_futex, (unsigned *)addr, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0); }

static void barrier(dk_pool *p, int which) {
    atomic_fetch_add_explicit(&p->arrived[which], 1, memory_order_acq_rel);
    int spins = 0;
    while (atomic_load_explicit(&p->arrived[which], memory_order_acquire) < p->threads)
        if (++spins < 4096) _mm_pause();
        else sched_yield(); /* more threads than free cores: let the late one run */
}

static uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void run_call(dk_pool *p, int me) {
    dk_call *c = &p->call;
    const dk_layer *L = c->L;
    const dk_isa_ops *ops = chosen;
    int H = L->hidden, I = L->inter, T = c->tokens, K = c->top_k;
    /* 0: activations into the ISA's form */
    for (int t = me; t < T; t += p->threads)
        ops->prepare(L->fmt, (const uint8_t *)c->x + (size_t)t * H * (c->x_bf16 ? 2 : 4), c->x_bf16, H,
                     c->xf + c->x_stride * t);
    barrier(p, 0);
    /* 1: gate/up */
    int rows = ops->gateup_rows(L->fmt, L->down_fmt);
    int per_expert = (I + rows - 1) / rows, items = c->used * per_expert;
    const void *xs[MAX_R];
    void *hs[MAX_R];
    float *ys[MAX_R];
    for (int it; (it = atomic_fetch_add_explicit(&c->next[1], 1, memory_order_relaxed)) < items;) {
        int u = it % c->used, chunk = it / c->used; /* neighbouring items on different experts */
        int i0 = chunk * rows, i1 = i0 + rows < I ? i0 + rows : I;
        for (int q0 = c->pair_start[u]; q0 < c->pair_start[u + 1]; q0 += MAX_R) {
            int R = c->pair_start[u + 1] - q0 < MAX_R ? c->pair_start[u + 1] - q0 : MAX_R;
            for (int r = 0; r < R; r++) {
                xs[r] = c->xf + c->x_stride * c->pair_row[q0 + r];
                hs[r] = c->h + c->h_stride * (q0 + r);
            }
            ops->gateup(L, c->expert[u], i0, i1, xs, R, hs);
        }
    }
    barrier(p, 1);
    /* 2: down */
    per_expert = (H + DOWN_ROWS - 1) / DOWN_ROWS;
    items = c->used * per_expert;
    for (int it; (it = atomic_fetch_add_explicit(&c->next[2], 1, memory_order_relaxed)) < items;) {
        int u = it % c->used, chunk = it / c->used;
        int n0 = chunk * DOWN_ROWS, n1 = n0 + DOWN_ROWS < H ? n0 + DOWN_ROWS : H;
        for (int q0 = c->pair_start[u]; q0 < c->pair_start[u + 1]; q0 += MAX_R) {
            int R = c->pair_start[u + 1] - q0 < MAX_R ? c->pair_start[u + 1] - q0 : MAX_R;
            for (int r = 0; r < R; r++) {
                xs[r] = c->h + c->h_stride * (q0 + r);
                ys[r] = c->y + (size_t)(q0 + r) * H;
            }
            ops->down(L, c->expert[u], n0, n1, xs, R, ys);
        }
    }
    barrier(p, 2);
    /* 3: out[t] = sum over slots in order of w * y */
    int col_items = (H + SUM_COLS - 1) / SUM_COLS;
    items = T * col_items;
    for (int it; (it = atomic_fetch_add_explicit(&c->next[3], 1, memory_order_relaxed)) < items;) {
        int t = it / col_items, n0 = (it % col_items) * SUM_COLS, n1 = n0 + SUM_COLS < H ? n0 + SUM_COLS : H;
        float acc[SUM_COLS];
        for (int n = n0; n < n1; n++) acc[n - n0] = 0.f;
        for (int k = 0; k < K; k++) {
            int q = c->pair_of[t * K + k];
            if (q < 0) continue;
            float w = c->weights[t * K + k];
            const float *y = c->y + (size_t)q * H;
            for (int n = n0; n < n1; n++) acc[n - n0] += w * y[n];
        }
        if (c->out_bf16) {
            uint16_t *o = (uint16_t *)c->out + (size_t)t * H;
            for (int n = n0; n < n1; n++) o[n] = to_bf16(acc[n - n0]);
        } else {
            float *o = (float *)c->out + (size_t)t * H;
            for (int n = n0; n < n1; n++) o[n] = acc[n - n0];
        }
    }
}

static void *worker(void *arg) {
    dk_pool *p = ((void **)arg)[0];
    int me = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    char name[16];
    snprintf(name, sizeof name, "ktserve-dk-%d", me);
    pthread_setname_np(pthread_self(), name);
    _mm_setcsr(0x1F80); /* IEEE: no flush-to-zero, whatever the creating thread had */
    if (p->cpus) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(p->cpus[me], &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    unsigned seen = 0; /* the pool starts at generation 0: a call submitted before this thread ran is still seen */
    for (;;) {
        long since = now_ns();
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen) {
            if (atomic_load(&p->stop)) return NULL;
            _mm_pause();
            if (++spins % 256 == 0) {
                if (now_ns() - since > p->spin_ns) futex_wait(&p->generation, seen);
                else sched_yield(); /* a pinned kt-kernel worker on this core gets its turn */
            }
        }
        seen = g;
        if (atomic_load(&p->stop)) return NULL;
        run_call(p, me);
        if (atomic_fetch_add_explicit(&p->finished, 1, memory_order_acq_rel) + 1 == p->threads) {
            atomic_int *done = p->call.done; /* read before busy clears: the next call may replace it */
            atomic_store_explicit(&p->busy, 0, memory_order_release);
            if (done) atomic_store_explicit(done, 1, memory_order_release);
        }
    }
}

/* threads workers; cpus: NULL, or one CPU per worker to pin it to; spin_us: how long an idle worker spins
 * before it sleeps */
dk_pool *dk_pool_create(int threads, const int *cpus, int spin_us) {
    if (threads < 1 || dk_isa() == 0) return NULL;
    dk_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->threads = threads;
    p->spin_ns = (long)spin_us * 1000;
    if (cpus) {
        p->cpus = malloc(sizeof(int) * threads);
        memcpy(p->cpus, cpus, sizeof(int) * threads);
    }
    pthread_mutex_init(&p->ids_lock, NULL);
    p->next_id = 1;
    p->tid = calloc(threads, sizeof(pthread_t));
    for (int i = 0; i < threads; i++) {
        void **arg = malloc(2 * sizeof(void *));
        arg[0] = p;
        arg[1] = (void *)(intptr_t)i;
        if (pthread_create(&p->tid[i], NULL, worker, arg)) {
            p->threads = i; /* the ones started are stopped by destroy */
            atomic_store(&p->stop, 1);
            return p;
        }
    }
    return p;
}

void dk_pool_destroy(dk_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->generation, 1);
    futex_wake(&p->generation);
    for (int i = 0; i < p->threads; i++) pthread_join(p->tid[i], NULL);
    if (p->watching) pthread_join(p->watcher, NULL);
    for (int i = 0; i < DK_TASK_PAGES; i++) free((void *)p->task_pages[i]);
    free(p->free_ids);
    pthread_mutex_destroy(&p->ids_lock);
    dk_call *c = &p->call;
    free(c->expert); free(c->pair_start); free(c->pair_row); free(c->pair_slot); free(c->pair_of);
    free(c->xf); free(c->h); free(c->y);
    free(p->tid); free(p->cpus); free(p);
}

static int grow_bytes(void *buf, size_t *cap, size_t need) {
    void **b = buf;
    if (need <= *cap && *b) return 0;
    free(*b);
    *b = aligned_alloc(64, (need + 63) / 64 * 64);
    *cap = *b ? need : 0;
    return *b ? 0 : -1;
}

static int grow(dk_pool *p, size_t tokens, size_t pairs, const dk_layer *L) {
    dk_call *c = &p->call;
    if (pairs > p->cap_pairs || !c->expert) {
        free(c->expert); free(c->pair_start); free(c->pair_row); free(c->pair_slot); free(c->pair_of);
        c->expert = malloc(sizeof(int) * pairs);
        c->pair_start = malloc(sizeof(int) * (pairs + 1));
        c->pair_row = malloc(sizeof(int) * pairs);
        c->pair_slot = malloc(sizeof(int) * pairs);
        c->pair_of = malloc(sizeof(int) * pairs);
        p->cap_pairs = pairs;
        if (!c->expert || !c->pair_start || !c->pair_row || !c->pair_slot || !c->pair_of) {
            p->cap_pairs = 0;
            return -1;
        }
    }
    /* row strides: multiples of 64 bytes (the forms are whole chunks or 32-column floats), rows stay aligned */
    c->x_stride = chosen->act_bytes(L->fmt, L->hidden);
    c->h_stride = chosen->act_bytes(L->down_fmt, L->inter);
    return grow_bytes(&c->xf, &p->cap_x, tokens * c->x_stride) || grow_bytes(&c->h, &p->cap_h, pairs * c->h_stride) ||
           grow_bytes(&c->y, &p->cap_y, pairs * L->hidden * sizeof(float));
}

static int submit(dk_pool *p, const dk_layer *L, int tokens, int top_k, const void *x, int x_bf16, const int64_t *ids,
                  const float *weights, void *out, int out_bf16, atomic_int *done);

/* Start a call and return: 0, or -1 while the previous call runs, -2 without memory, -3 for bad sizes.
 * x: [tokens, hidden] bf16 (x_bf16) or float; ids [tokens, top_k] (ids outside 0..experts-1, e.g. -1, add
 * nothing); weights [tokens, top_k] float; out [tokens, hidden] bf16 (out_bf16) or float. */
int dk_submit(dk_pool *p, const dk_layer *L, int tokens, int top_k, const void *x, int x_bf16, const int64_t *ids,
              const float *weights, void *out, int out_bf16) {
    return submit(p, L, tokens, top_k, x, x_bf16, ids, weights, out, out_bf16, NULL);
}

/* dk_submit; `done` (or NULL) is set to 1 when the call ends. Returns before starting one (tokens 0, an error)
 * leave `done` as it is. */
static int submit(dk_pool *p, const dk_layer *L, int tokens, int top_k, const void *x, int x_bf16, const int64_t *ids,
                  const float *weights, void *out, int out_bf16, atomic_int *done) {
    if (atomic_load_explicit(&p->busy, memory_order_acquire)) return -1;
    if (tokens < 0 || top_k < 1 || top_k > 64) return -3;
    if (tokens == 0) return 0;
    size_t pairs = (size_t)tokens * top_k;
    if (grow(p, tokens, pairs, L)) return -2;
    dk_call *c = &p->call;
    c->L = L; c->tokens = tokens; c->top_k = top_k; c->x = x; c->x_bf16 = x_bf16;
    c->ids = ids; c->weights = weights; c->out = out; c->out_bf16 = out_bf16; c->done = done;
    /* experts in first-use order; each one's pairs in (row, slot) order */
    int used = 0;
    for (size_t q = 0; q < pairs; q++) {
        int64_t e = ids[q];
        c->pair_of[q] = -1;
        if (e < 0 || e >= L->experts) continue;
        int u = 0;
        while (u < used && c->expert[u] != (int)e) u++;
        if (u == used) c->expert[used++] = (int)e;
        c->pair_of[q] = u; /* the expert's index for now; its pair index below */
    }
    int n = 0;
    for (int u = 0; u < used; u++) {
        c->pair_start[u] = n;
        for (size_t q = 0; q < pairs; q++)
            if (c->pair_of[q] == u && c->expert[u] == (int)ids[q]) {
                c->pair_row[n] = (int)(q / top_k);
                c->pair_slot[n] = (int)(q % top_k);
                n++;
            }
    }
    c->pair_start[used] = n;
    for (int q = 0; q < n; q++) c->pair_of[c->pair_row[q] * top_k + c->pair_slot[q]] = q;
    c->used = used;
    for (int i = 0; i < 4; i++) {
        atomic_store_explicit(&c->next[i], 0, memory_order_relaxed);
        atomic_store_explicit(&p->arrived[i], 0, memory_order_relaxed);
    }
    atomic_store_explicit(&p->finished, 0, memory_order_relaxed);
    atomic_store_explicit(&p->busy, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    futex_wake(&p->generation);
    return 0;
}

/* Wait for the call dk_submit started (returns at once when none runs). */
void dk_wait(dk_pool *p) {
    int spins = 0;
    while (atomic_load_explicit(&p->busy, memory_order_acquire)) {
        _mm_pause();
        if (++spins % 4096 == 0) sched_yield();
    }
}

int dk_forward(dk_pool *p, const dk_layer *L, int tokens, int top_k, const void *x, int x_bf16, const int64_t *ids,
               const float *weights, void *out, int out_bf16) {
    int rc = dk_submit(p, L, tokens, top_k, x, x_bf16, ids, weights, out, out_bf16);
    if (rc == 0) dk_wait(p);
    return rc;
}

int dk_pool_threads(const dk_pool *p) { return p->threads; }

/* ------------------------------------------------------------------------------- CUDA stream tasks */
/* A call whose buffers never move (pinned host memory a captured CUDA graph replays), its token count read
 * through `tokens` when the stream reaches it. A stream starts and awaits it in one of two ways:
 *   host functions: `dk_task_submit` and `dk_task_wait` for cudaLaunchHostFunc, with the task as their argument
 *     (the driver's callback thread runs them: tens of microseconds from the stream to the call and back);
 *   host memory: the stream writes the task's id into one of the pool's doorbells (dk_pool_watch) and waits for
 *     the task's done cell to read 1 (dk_task_bind), both stream memory operations on pinned cells; the pool's
 *     watcher thread spins on the doorbells while calls keep coming and starts the call, whose last worker
 *     sets the done cell. The stream resets it to 0 after its wait. */
struct dk_task {
    dk_pool *p;
    const dk_layer *L;
    const int *tokens;
    int top_k, x_bf16, out_bf16;
    const void *x;
    const int64_t *ids;
    const float *weights;
    void *out;
    int id;          /* > 0 once bound */
    atomic_int *done;
};

dk_task *dk_task_create(dk_pool *p, const dk_layer *L, const int *tokens, int top_k, const void *x, int x_bf16,
                        const int64_t *ids, const float *weights, void *out, int out_bf16) {
    dk_task *t = malloc(sizeof *t);
    if (!t) return NULL;
    *t = (dk_task){p, L, tokens, top_k, x_bf16, out_bf16, x, ids, weights, out, 0, NULL};
    return t;
}

static _Atomic(dk_task *) *task_slot(dk_pool *p, int id) {
    _Atomic(dk_task *) *page = p->task_pages[id / DK_TASK_PAGE];
    return page ? &page[id % DK_TASK_PAGE] : NULL;
}

/* Give `t` an id the watcher knows it by, its done cell `done` (pinned host memory, 0 now). Returns the id, or
 * -1 (no ids left, no memory). */
int dk_task_bind(dk_task *t, int *done) {
    dk_pool *p = t->p;
    if (t->id) return t->id;
    pthread_mutex_lock(&p->ids_lock);
    int id = p->n_free ? p->free_ids[--p->n_free] : p->next_id < DK_TASK_PAGE * DK_TASK_PAGES ? p->next_id++ : -1;
    if (id > 0 && !p->task_pages[id / DK_TASK_PAGE]) {
        void *page = calloc(DK_TASK_PAGE, sizeof(dk_task *));
        if (page) p->task_pages[id / DK_TASK_PAGE] = page;
        else { p->next_id--; id = -1; }
    }
    if (id > 0) {
        t->id = id;
        t->done = (atomic_int *)done;
        atomic_store_explicit(task_slot(p, id), t, memory_order_release);
    }
    pthread_mutex_unlock(&p->ids_lock);
    return id;
}

void dk_task_destroy(dk_task *t) {
    if (t && t->id) {
        dk_pool *p = t->p;
        pthread_mutex_lock(&p->ids_lock);
        atomic_store_explicit(task_slot(p, t->id), NULL, memory_order_release);
        int *grown = realloc(p->free_ids, sizeof(int) * (p->n_free + 1));
        if (grown) {
            p->free_ids = grown;
            p->free_ids[p->n_free++] = t->id;
        }
        pthread_mutex_unlock(&p->ids_lock);
    }
    free(t);
}

void dk_task_submit(void *arg) {
    dk_task *t = arg;
    dk_wait(t->p);
    dk_submit(t->p, t->L, *t->tokens, t->top_k, t->x, t->x_bf16, t->ids, t->weights, t->out, t->out_bf16);
}

void dk_task_wait(void *arg) { dk_wait(((dk_task *)arg)->p); }

static void rung(dk_pool *p, int id) {
    _Atomic(dk_task *) *slot = task_slot(p, id);
    dk_task *t = slot ? atomic_load_explicit(slot, memory_order_acquire) : NULL;
    if (!t) return; /* no such task: nothing a stream waits for */
    dk_wait(p);
    int rows = *t->tokens;
    if (rows <= 0 || submit(p, t->L, rows, t->top_k, t->x, t->x_bf16, t->ids, t->weights, t->out, t->out_bf16, t->done))
        atomic_store_explicit(t->done, 1, memory_order_release); /* no call started (no rows, no memory): done */
}

#define DK_WATCHER_NAME "ktserve-dk-bell"
#define WATCH_IDLE_NS 1000000000L /* after a second without a call the watcher polls every millisecond */

/* Keep the watcher off the workers' CPUs: on the CPUs this thread may run on that no worker is pinned to (left as
 * it is when the workers are not pinned or take every CPU). Named DK_WATCHER_NAME, which the engine's worker
 * isolation (engines/kt/experts/cpuinfer.py) knows is no worker even where one CPU is left to it. */
static void place_watcher(dk_pool *p) {
    pthread_setname_np(pthread_self(), DK_WATCHER_NAME);
    cpu_set_t allowed;
    if (!p->cpus || sched_getaffinity(0, sizeof allowed, &allowed)) return;
    for (int i = 0; i < p->threads; i++)
        if (p->cpus[i] >= 0 && p->cpus[i] < CPU_SETSIZE) CPU_CLR(p->cpus[i], &allowed);
    if (CPU_COUNT(&allowed)) pthread_setaffinity_np(pthread_self(), sizeof allowed, &allowed);
}

static void *watch(void *arg) {
    dk_pool *p = arg;
    place_watcher(p);
    long last = now_ns();
    int spins = 0;
    while (!atomic_load_explicit(&p->stop, memory_order_relaxed)) {
        int any = 0;
        for (int b = 0; b < DK_BELLS; b++) {
            int id = atomic_load_explicit(&p->bells[b], memory_order_acquire);
            if (!id) continue;
            atomic_store_explicit(&p->bells[b], 0, memory_order_relaxed);
            rung(p, id);
            any = 1;
        }
        if (any) {
            last = now_ns();
            spins = 0;
            continue;
        }
        _mm_pause();
        if (++spins % 256) continue;
        long idle = now_ns() - last;
        if (idle > p->spin_ns) {
            struct timespec nap = {0, idle > WATCH_IDLE_NS ? 1000000L : 20000L};
            nanosleep(&nap, NULL);
        } else {
            sched_yield();
        }
    }
    return NULL;
}

/* Start the pool's watcher over `bells` (DK_BELLS int cells of pinned host memory, all 0, kept for the pool's
 * life); a second call changes nothing. Returns 0, or -1 when the thread does not start. */
int dk_pool_watch(dk_pool *p, int *bells) {
    pthread_mutex_lock(&p->ids_lock);
    int rc = 0;
    if (!p->watching) {
        p->bells = (atomic_int *)bells;
        rc = pthread_create(&p->watcher, NULL, watch, p) ? -1 : 0;
        p->watching = rc == 0;
    }
    pthread_mutex_unlock(&p->ids_lock);
    return rc;
}

int dk_pool_bells(void) { return DK_BELLS; }
