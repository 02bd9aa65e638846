/* check(v) of the two memory modes. ecc: hardware error detection, nothing to do in
 * software. dup: a shadow copy of every byte a validated handler wrote; handler reads
 * compare memory with it, so a flip between handlers is caught on the next read.
 * The shadow holds 64-byte lines, split into independent shards, each with its own
 * lock and linear probing, so that threads working on different lines rarely meet. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int sei_dup;

__attribute__((weak)) extern const int sei_build_mode;

#define SHARDS 64
#define WORDS_PER_LINE 8
#define DEFAULT_DUP_WORDS (1ul << 28) /* the most state dup mode copies: 2 GiB */
#define INITIAL_SLOTS 256              /* lines per shard at start; grows by doubling */

/* The copy of one 64-byte line: the value and protected bytes of each of its words. A
 * bulk read or a freed block then costs one lookup per line, not per word. */
struct shadow_line {
    uintptr_t addr; /* the line's address; 0: a free slot */
    uint64_t value[WORDS_PER_LINE];
    uint8_t mask[WORDS_PER_LINE];
};

struct shard {
    pthread_spinlock_t lock;
    struct shadow_line *lines;
    uint32_t slots; /* a power of two */
    uint32_t used;
} __attribute__((aligned(64))); /* one cache line per shard: no false sharing */

static struct shard shards[SHARDS];
static size_t max_shard_slots; /* SEI_DUP_WORDS, per shard, in lines */
static pthread_once_t mode_once = PTHREAD_ONCE_INIT;

static void init_once(void) {
    const char *mode = getenv("SEI_MODE");
    if (mode == NULL || *mode == 0)
        sei_dup = (&sei_build_mode != NULL && sei_build_mode == SEI_MODE_DUP);
    else if (strcmp(mode, "dup") == 0)
        sei_dup = 1;
    else if (strcmp(mode, "ecc") == 0)
        sei_dup = 0;
    else
        sei_unsupported("SEI_MODE=%s: expected ecc or dup", mode);
    if (!sei_dup) return;
    size_t words = DEFAULT_DUP_WORDS;
    const char *limit = getenv("SEI_DUP_WORDS");
    if (limit != NULL && *limit != 0) {
        char *end;
        words = strtoul(limit, &end, 10);
        if (*end != 0 || words < 8 * SHARDS || words > (1ul << 30))
            sei_unsupported("SEI_DUP_WORDS=%s: expected a number from 512 to 1073741824", limit);
    }
    max_shard_slots = 1;
    while (max_shard_slots * SHARDS * WORDS_PER_LINE < words) max_shard_slots <<= 1;
    for (int i = 0; i < SHARDS; i++) {
        pthread_spin_init(&shards[i].lock, PTHREAD_PROCESS_PRIVATE);
        shards[i].slots = INITIAL_SLOTS;
        shards[i].lines = calloc(INITIAL_SLOTS, sizeof(struct shadow_line));
        if (shards[i].lines == NULL) sei_unsupported("out of memory for the dup-mode shadow");
    }
}

void sei_mode_init(void) { pthread_once(&mode_once, init_once); }

enum sei_mode sei_mode(void) {
    sei_mode_init();
    return sei_dup ? SEI_MODE_DUP : SEI_MODE_ECC;
}

static inline uintptr_t line_of(uintptr_t addr) { return addr & ~(uintptr_t)63; }
static inline uint64_t hash_line(uintptr_t line) { return (uint64_t)(line >> 6) * 0x9e3779b97f4a7c15ull; }
static inline struct shard *shard_of(uintptr_t line) { return &shards[hash_line(line) >> 58]; }
static inline uint32_t home_of(const struct shard *s, uintptr_t line) {
    return (uint32_t)(hash_line(line) >> 20) & (s->slots - 1);
}

/* Doubles a shard that reached 7/8 load (under its lock): the shadow grows with the
 * state handlers write, up to SEI_DUP_WORDS. */
static void grow(struct shard *s) {
    if ((size_t)s->slots * 2 > max_shard_slots)
        sei_unsupported("the dup-mode shadow is full; raise SEI_DUP_WORDS");
    uint32_t old_slots = s->slots;
    struct shadow_line *old = s->lines;
    struct shadow_line *lines = calloc((size_t)old_slots * 2, sizeof *lines);
    if (lines == NULL) sei_unsupported("out of memory growing the dup-mode shadow");
    s->lines = lines;
    s->slots = old_slots * 2;
    for (uint32_t i = 0; i < old_slots; i++) {
        if (old[i].addr == 0) continue;
        uint32_t j = home_of(s, old[i].addr);
        while (s->lines[j].addr != 0) j = (j + 1) & (s->slots - 1);
        s->lines[j] = old[i];
    }
    free(old);
}

/* The copy of line, or NULL; with create, a new empty one. The shard is locked. */
static struct shadow_line *lookup(struct shard *s, uintptr_t line, int create) {
    if (create && s->used + 1 >= s->slots - s->slots / 8) grow(s);
    uint32_t mask = s->slots - 1;
    for (uint32_t i = home_of(s, line), n = 0; n < s->slots; i = (i + 1) & mask, n++) {
        struct shadow_line *l = &s->lines[i];
        if (l->addr == line) return l;
        if (l->addr == 0) {
            if (!create) return NULL;
            s->used++;
            memset(l, 0, sizeof *l);
            l->addr = line;
            return l;
        }
    }
    return NULL;
}

/* Removes the line at slot i by backward-shift deletion: later entries of the probe
 * run move up, so that the load stays the live protected lines (no tombstones). */
static void remove_at(struct shard *s, uint32_t i) {
    uint32_t mask = s->slots - 1;
    for (uint32_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        struct shadow_line *l = &s->lines[j];
        if (l->addr == 0) break;
        uint32_t home = home_of(s, l->addr);
        /* l may fill the hole at i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            s->lines[i] = *l;
            i = j;
        }
    }
    s->lines[i].addr = 0;
    s->used--;
}

#define bytes_of sei_byte_mask

/* Bytes of word that the running handler wrote itself and that have no valid copy yet. */
static uint8_t own_bytes(const struct sei_thread *t, uintptr_t word) {
    if (t == NULL || !sei_in_handler(t) || t->nwords == 0) return 0;
    const struct sei_word *w = sei_log_find(t, word);
    if (w == NULL) return 0;
    return t->phase == PHASE_E1 ? w->mask_e1 : w->mask_e2;
}

/* Calls visit(line copy, word index, word) for each word of [addr, addr+len) whose
 * line has a copy (or, with create, for each word), one lock per line. */
#define FOR_EACH_WORD(addr, len, create, BODY)                                          \
    do {                                                                               \
        uintptr_t end_ = (addr) + (len);                                               \
        for (uintptr_t line_ = line_of(addr); line_ < end_; line_ += 64) {             \
            struct shard *s_ = shard_of(line_);                                        \
            pthread_spin_lock(&s_->lock);                                              \
            struct shadow_line *l_ = lookup(s_, line_, (create));                      \
            if (l_ != NULL) {                                                          \
                uintptr_t lo_ = (addr) > line_ ? ((addr) & ~(uintptr_t)7) : line_;     \
                uintptr_t hi_ = end_ < line_ + 64 ? end_ : line_ + 64;                  \
                for (uintptr_t word = lo_; word < hi_; word += 8) {                    \
                    unsigned k = (unsigned)((word - line_) >> 3);                       \
                    BODY                                                               \
                }                                                                      \
            }                                                                          \
            pthread_spin_unlock(&s_->lock);                                            \
        }                                                                              \
    } while (0)

void sei_dup_check(const struct sei_thread *t, uintptr_t addr, size_t len) {
    if (len == 0) return;
    if (t != NULL && sei_in_handler(t)) {
        /* No copy to compare, or no need: the input message (its CRC is checked again in
         * V) and the handler's own frames (never logged, so never copied). Parsers read
         * these byte by byte, and each check costs a shard lock. */
        uintptr_t end = addr + len, msg = (uintptr_t)t->msg;
        if (msg != 0 && addr >= msg && end <= msg + t->msg_len) return;
        if (addr >= t->stack_low && end <= t->checkpoint.cfa) return;
    }
    uintptr_t bad = 0;
    uint64_t bad_now = 0, bad_copy = 0;
    FOR_EACH_WORD(addr, len, 0, {
        uint8_t mask = l_->mask[k];
        if (mask != 0 && bad == 0) {
            mask &= (uint8_t)~own_bytes(t, word);
            uint64_t now = *(volatile const uint64_t *)word;
            if (((now ^ l_->value[k]) & bytes_of(mask)) != 0) {
                bad = word;
                bad_now = now & bytes_of(mask);
                bad_copy = l_->value[k] & bytes_of(mask);
            }
        }
    });
    if (bad != 0)
        sei_fail("dup mode: %p holds %016llx, its copy %016llx (memory corrupted between handlers)", (void *)bad,
                 (unsigned long long)bad_now, (unsigned long long)bad_copy);
}

void sei_dup_commit(const struct sei_thread *t) {
    for (uint32_t i = 0; i < t->nwords; i++) {
        const struct sei_word *lw = &t->words[i];
        uintptr_t line = line_of(lw->addr);
        struct shard *s = shard_of(line);
        pthread_spin_lock(&s->lock);
        struct shadow_line *l = lookup(s, line, 1);
        unsigned k = (unsigned)((lw->addr - line) >> 3);
        uint64_t m = bytes_of(lw->mask_e2);
        l->value[k] = (l->value[k] & ~m) | (*(volatile const uint64_t *)lw->addr & m);
        l->mask[k] |= lw->mask_e2;
        pthread_spin_unlock(&s->lock);
    }
}

void sei_dup_forget(uintptr_t addr, size_t len) {
    if (!sei_dup || len == 0) return;
    uintptr_t end = addr + len;
    for (uintptr_t line = line_of(addr); line < end; line += 64) {
        struct shard *s = shard_of(line);
        pthread_spin_lock(&s->lock);
        struct shadow_line *l = lookup(s, line, 0);
        if (l != NULL) {
            int live = 0;
            for (unsigned k = 0; k < WORDS_PER_LINE; k++) {
                uintptr_t word = line + 8 * k;
                if (word + 8 > addr && word < end) l->mask[k] = 0;
                live |= l->mask[k];
            }
            if (!live) remove_at(s, (uint32_t)(l - s->lines));
        }
        pthread_spin_unlock(&s->lock);
    }
}
