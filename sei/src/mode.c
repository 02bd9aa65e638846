/* check(v) of the two memory modes. ecc: hardware error detection, nothing to do in
 * software. dup: a shadow copy of every byte a validated handler wrote; handler reads
 * compare memory with it, so a flip between handlers is caught on the next read.
 * The shadow is split into independent shards, each with its own lock and linear
 * probing, so that threads working on different words rarely meet. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"

int sei_dup;

__attribute__((weak)) extern const int sei_build_mode;

#define SHARDS 64
#define DEFAULT_DUP_WORDS (1u << 20)

struct shadow_word {
    uintptr_t addr; /* 0: never used */
    uint64_t value;
    uint8_t mask; /* protected bytes; 0 after the word was freed */
};

struct shard {
    pthread_spinlock_t lock;
    struct shadow_word *words;
    uint32_t used;
} __attribute__((aligned(64))); /* one cache line per shard: no false sharing */

static struct shard shards[SHARDS];
static uint32_t shard_slots; /* power of two */
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
        if (*end != 0 || words < SHARDS || words > (1ul << 30))
            sei_unsupported("SEI_DUP_WORDS=%s: expected a number from 64 to 1073741824", limit);
    }
    shard_slots = 1;
    while ((size_t)shard_slots * SHARDS < words) shard_slots <<= 1;
    for (int i = 0; i < SHARDS; i++) {
        pthread_spin_init(&shards[i].lock, PTHREAD_PROCESS_PRIVATE);
        /* untouched pages cost nothing: the table is as large as the state it copies */
        void *m = mmap(NULL, (size_t)shard_slots * sizeof(struct shadow_word), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) sei_unsupported("cannot map the dup-mode shadow (SEI_DUP_WORDS too large?)");
        shards[i].words = m;
    }
}

void sei_mode_init(void) { pthread_once(&mode_once, init_once); }

enum sei_mode sei_mode(void) {
    sei_mode_init();
    return sei_dup ? SEI_MODE_DUP : SEI_MODE_ECC;
}

/* Words are placed by 512-byte region: the region's hash picks the shard (top bits) and
 * the first slot (middle bits), and the word's index in the region is added, so that a
 * bulk read of a region walks consecutive slots instead of missing the cache per word. */
static inline uint64_t region_hash(uintptr_t word) { return (uint64_t)(word >> 9) * 0x9e3779b97f4a7c15ull; }
static inline uint64_t hash_word(uintptr_t word) { return (region_hash(word) >> 20) + ((word >> 3) & 63); }

/* A shard holds whole regions, so that a bulk read or a freed block takes few locks. */
static inline struct shard *shard_of(uintptr_t word) { return &shards[region_hash(word) >> 58]; }

/* The entry for word, or NULL; with create, a new entry. The shard is locked. */
static struct shadow_word *lookup(struct shard *s, uint64_t h, uintptr_t word, int create) {
    uint32_t mask = shard_slots - 1;
    for (uint32_t i = (uint32_t)h & mask, n = 0; n < shard_slots; i = (i + 1) & mask, n++) {
        struct shadow_word *w = &s->words[i];
        if (w->addr == word) return w;
        if (w->addr == 0) {
            if (!create) return NULL;
            if (s->used + 1 >= shard_slots - shard_slots / 8)
                sei_unsupported("the dup-mode shadow is full; raise SEI_DUP_WORDS");
            s->used++;
            w->addr = word;
            w->mask = 0;
            return w;
        }
    }
    return NULL;
}

#define bytes_of sei_byte_mask

/* Bytes of word that the running handler wrote itself and that have no valid copy yet. */
static uint8_t own_bytes(const struct sei_thread *t, uintptr_t word) {
    if (t == NULL || !sei_in_handler(t)) return 0;
    const struct sei_word *w = sei_log_find(t, word);
    if (w == NULL) return 0;
    return t->phase == PHASE_E1 ? w->mask_e1 : w->mask_e2;
}

void sei_dup_check(const struct sei_thread *t, uintptr_t addr, size_t len) {
    if (len == 0) return;
    uintptr_t end = addr + len;
    struct shard *locked = NULL;
    for (uintptr_t word = addr & ~(uintptr_t)7; word < end; word += 8) {
        struct shard *s = shard_of(word);
        if (s != locked) {
            if (locked) pthread_spin_unlock(&locked->lock);
            pthread_spin_lock(&s->lock);
            locked = s;
        }
        struct shadow_word *w = lookup(s, hash_word(word), word, 0);
        if (w == NULL) continue;
        uint8_t mask = w->mask & (uint8_t)~own_bytes(t, word);
        uint64_t now = *(volatile const uint64_t *)word;
        if (((now ^ w->value) & bytes_of(mask)) != 0) {
            uint64_t copy = w->value;
            pthread_spin_unlock(&s->lock);
            sei_fail("dup mode: %p holds %016llx, its copy %016llx (memory corrupted between handlers)",
                     (void *)word, (unsigned long long)(now & bytes_of(mask)),
                     (unsigned long long)(copy & bytes_of(mask)));
        }
    }
    if (locked) pthread_spin_unlock(&locked->lock);
}

void sei_dup_commit(const struct sei_thread *t) {
    for (uint32_t i = 0; i < t->nwords; i++) {
        const struct sei_word *lw = &t->words[i];
        struct shard *s = shard_of(lw->addr);
        pthread_spin_lock(&s->lock);
        struct shadow_word *w = lookup(s, hash_word(lw->addr), lw->addr, 1);
        uint64_t m = bytes_of(lw->mask_e2);
        w->value = (w->value & ~m) | (*(volatile const uint64_t *)lw->addr & m);
        w->mask |= lw->mask_e2;
        pthread_spin_unlock(&s->lock);
    }
}

/* Removes the entry at slot i by backward-shift deletion: later entries of the probe
 * run move up, so that the table's load stays the live protected words (freed blocks
 * leave no tombstones to probe through). The shard is locked. */
static void remove_at(struct shard *s, uint32_t i) {
    uint32_t mask = shard_slots - 1;
    for (uint32_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        struct shadow_word *w = &s->words[j];
        if (w->addr == 0) break;
        uint32_t home = (uint32_t)hash_word(w->addr) & mask;
        /* w may fill the hole at i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            s->words[i] = *w;
            i = j;
        }
    }
    s->words[i].addr = 0;
    s->words[i].mask = 0;
    s->used--;
}

void sei_dup_forget(uintptr_t addr, size_t len) {
    if (!sei_dup || len == 0) return;
    uintptr_t end = addr + len;
    struct shard *locked = NULL;
    for (uintptr_t word = addr & ~(uintptr_t)7; word < end; word += 8) {
        struct shard *s = shard_of(word);
        if (s != locked) {
            if (locked) pthread_spin_unlock(&locked->lock);
            pthread_spin_lock(&s->lock);
            locked = s;
        }
        struct shadow_word *w = lookup(s, hash_word(word), word, 0);
        if (w != NULL) remove_at(s, (uint32_t)(w - s->words));
    }
    if (locked) pthread_spin_unlock(&locked->lock);
}
