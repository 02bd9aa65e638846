/* The write log: rules R2 and R6 (Figure 4b of the SEI paper), the reset phase R and
 * the state comparison of V. Granularity is the 8-byte word with a mask of the bytes
 * written, so that restoring a word never touches bytes the handler did not write
 * (another thread may own them under another lock). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define byte_mask sei_byte_mask

static inline uint64_t load_word(uintptr_t word) { return *(volatile const uint64_t *)word; }

/* Stores only the masked bytes of value into the word. */
static void store_masked(uintptr_t word, uint64_t value, uint8_t mask) {
    if (mask == 0xff) {
        *(volatile uint64_t *)word = value;
        return;
    }
    volatile unsigned char *p = (volatile unsigned char *)word;
    for (int i = 0; i < 8; i++)
        if (mask & (1u << i)) p[i] = (unsigned char)(value >> (8 * i));
}

/* Allocates room for `capacity` entries and an index at most half full, and files the
 * entries already logged under it. */
static int resize(struct sei_thread *t, uint32_t capacity) {
    uint32_t slots = 1;
    while (slots < 2 * capacity) slots <<= 1;
    struct sei_word *words = realloc(t->words, (size_t)capacity * sizeof *words);
    if (words == NULL) return 0;
    t->words = words;
    uint32_t *index = calloc(slots, sizeof *index);
    if (index == NULL) return 0;
    free(t->index);
    t->index = index;
    t->index_mask = slots - 1;
    t->capacity = capacity;
    for (uint32_t i = 0; i < t->nwords; i++) {
        uint32_t h = (uint32_t)((t->words[i].addr >> 3) * 0x9e3779b1u) & t->index_mask;
        while (t->index[h] != 0) h = (h + 1) & t->index_mask;
        t->index[h] = i + 1;
    }
    return 1;
}

void sei_log_init(struct sei_thread *t) {
    if (!resize(t, t->max_words < SEI_INITIAL_WORDS ? t->max_words : SEI_INITIAL_WORDS))
        sei_unsupported("out of memory for the write log");
}

/* The write log is full: grow it, or stop with what a developer needs to act. */
static void grow_log(struct sei_thread *t, uintptr_t word) {
    if (t->capacity < t->max_words) {
        uint32_t capacity = t->capacity > t->max_words / 2 ? t->max_words : 2 * t->capacity;
        if (!resize(t, capacity)) sei_unsupported("out of memory growing the write log to %u words", capacity);
        return;
    }
    char where[160];
    sei_data_symbol((const void *)word, where, sizeof where);
    sei_unsupported("a handler wrote more than %u words of state (8 bytes each), the last at %p%s%s; raise "
                    "SEI_MAX_WORDS, or call sei_ignore_addr on a scratch buffer",
                    t->max_words, (void *)word, where[0] ? ", in " : "", where);
}

void sei_log_clear(struct sei_thread *t) {
    /* clearing only the used slots keeps a handler's cost proportional to its writes */
    for (uint32_t i = 0; i < t->nwords; i++) {
        uint32_t h = (uint32_t)((t->words[i].addr >> 3) * 0x9e3779b1u) & t->index_mask;
        while (t->index[h] != 0) {
            t->index[h] = 0;
            h = (h + 1) & t->index_mask;
        }
    }
    t->nwords = 0;
}

static inline uint32_t slot_of(const struct sei_thread *t, uintptr_t word) {
    return (uint32_t)((word >> 3) * 0x9e3779b1u) & t->index_mask;
}

struct sei_word *sei_log_find(const struct sei_thread *t, uintptr_t word) {
    for (uint32_t h = slot_of(t, word);; h = (h + 1) & t->index_mask) {
        uint32_t i = t->index[h];
        if (i == 0) return NULL;
        if (t->words[i - 1].addr == word) return &t->words[i - 1];
    }
}

static struct sei_word *insert(struct sei_thread *t, uintptr_t word) {
    uint32_t h = slot_of(t, word);
    for (;; h = (h + 1) & t->index_mask) {
        uint32_t i = t->index[h];
        if (i == 0) break;
        if (t->words[i - 1].addr == word) return &t->words[i - 1];
    }
    if (t->nwords == t->capacity) {
        grow_log(t, word);
        for (h = slot_of(t, word); t->index[h] != 0; h = (h + 1) & t->index_mask) {
        }
    }
    struct sei_word *w = &t->words[t->nwords];
    /* Ov(v) is written once, into an entry no execution has marked (Figure 4b, line 3) */
    w->addr = word;
    w->old = load_word(word);
    w->fresh = 0;
    w->mask_e1 = 0;
    w->mask_e2 = 0;
    t->nwords++;
    t->index[h] = t->nwords;
    return w;
}

static int ignored(const struct sei_thread *t, uintptr_t addr) {
    for (uint32_t i = 0; i < t->nignored; i++)
        if (addr >= t->ignored[i].start && addr < t->ignored[i].end) return 1;
    return 0;
}

/* One word of a write barrier, before the store (the caller stores afterwards). */
static inline void log_word(struct sei_thread *t, uintptr_t word, uint8_t mask) {
    if (t->phase == PHASE_E1 && t->phase_check == ~(uint32_t)PHASE_E1) {
        struct sei_word *w = insert(t, word);
        if ((w->mask_e1 & mask) != mask) {
            /* first write to these bytes: the snapshot must still hold their value */
            uint64_t fresh_bytes = byte_mask((uint8_t)(mask & ~w->mask_e1));
            if (((w->old ^ load_word(word)) & fresh_bytes) != 0)
                sei_fail("snapshot of %p does not match memory (R2)", (void *)word);
            w->mask_e1 |= mask;
        }
        if ((w->mask_e1 & mask) != mask) sei_fail("R2 gate: %p not in the snapshot", (void *)word);
    } else if (t->phase == PHASE_E2 && t->phase_check == ~(uint32_t)PHASE_E2) {
        struct sei_word *w = sei_log_find(t, word);
        if (w == NULL || (w->mask_e1 & mask) != mask)
            sei_fail("E2 wrote %p, which E1 did not write", (void *)word);
        w->mask_e2 |= mask;
        if ((w->mask_e2 & mask) != mask) sei_fail("R6 gate: %p not in the update set", (void *)word);
    } else {
        sei_fail("control-flow gate: a write barrier outside E1 and E2 (%p)", (void *)word);
    }
}

void sei_log_write(struct sei_thread *t, uintptr_t addr, size_t len) {
    if (len == 0) return;
    /* The stack below the handler's frame dies with the handler: it is neither state
     * nor restorable (R runs there), so it is written directly. */
    if (addr < t->checkpoint.cfa && addr >= t->stack_low) return;
    if (__builtin_expect(t->nignored != 0, 0) && ignored(t, addr)) return;
    unsigned offset = (unsigned)(addr & 7);
    if (offset + len <= 8) { /* the common case: one scalar store within one word */
        log_word(t, addr - offset, (uint8_t)(((1u << len) - 1) << offset));
        return;
    }
    uintptr_t end = addr + len;
    for (uintptr_t word = addr & ~(uintptr_t)7; word < end; word += 8) {
        uintptr_t lo = addr > word ? addr : word;
        uintptr_t hi = end < word + 8 ? end : word + 8;
        uint8_t mask = (uint8_t)(((1u << (hi - lo)) - 1) << (lo - word));
        log_word(t, word, mask);
    }
}

void sei_log_reset(struct sei_thread *t) {
    sei_expect_phase(t, PHASE_RESET, "R");
    for (uint32_t i = 0; i < t->nwords; i++) {
        struct sei_word *w = &t->words[i];
        w->fresh = load_word(w->addr);
        store_masked(w->addr, w->old, w->mask_e1);
    }
    sei_expect_phase(t, PHASE_RESET, "R's end");
}

/* Used by a cancelled handler: E2's updates are undone too. */
void sei_log_undo(struct sei_thread *t) {
    for (uint32_t i = 0; i < t->nwords; i++) store_masked(t->words[i].addr, t->words[i].old, t->words[i].mask_e1);
}

/* V: N and U hold the same bytes, and the state equals N. */
void sei_log_validate(struct sei_thread *t) {
    sei_expect_phase(t, PHASE_VALIDATE, "V");
    for (uint32_t i = 0; i < t->nwords; i++) {
        const struct sei_word *w = &t->words[i];
        if (w->mask_e1 != w->mask_e2)
            sei_fail("E1 and E2 wrote different bytes of %p (masks %02x, %02x)", (void *)w->addr, w->mask_e1,
                     w->mask_e2);
        uint64_t m = byte_mask(w->mask_e1);
        uint64_t now = load_word(w->addr);
        if (((now ^ w->fresh) & m) != 0)
            sei_fail("E1 and E2 disagree on %p: %016llx vs %016llx", (void *)w->addr,
                     (unsigned long long)(w->fresh & m), (unsigned long long)(now & m));
    }
    sei_expect_phase(t, PHASE_VALIDATE, "V's end");
}
