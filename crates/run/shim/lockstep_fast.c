/* lockstep_fast.c - in-process syscall interception for the `lockstep run` fast path
 * (issue 16, part B). Loaded with LD_PRELOAD; inert unless LOCKSTEP_FAST is set.
 *
 * Interception, after lazypoline: Syscall User Dispatch (SUD) is the catch-all. A syscall
 * made outside this library's own code raises SIGSYS; the handler rewrites that site's
 * `syscall` (0f 05) into `call *%rax` (ff d0) and runs the call. From then on the site
 * calls the trampoline directly: `rax` holds the syscall number, so the call lands in a
 * nop sled on page 0 that slides into `lf_entry`, which calls `lf_dispatch` and returns
 * to the instruction after the site. Under ptrace each SIGSYS is a signal stop, so SUD is
 * only the discovery path: a site costs one stop, once.
 *
 * Calls that must not run through a `call` (their stack or their return differs:
 * rt_sigreturn, clone, clone3, fork, vfork, execve, execveat) are never rewritten. For
 * them the handler opens an ALLOW window (the SUD selector) and makes the thread run the
 * original instruction again; the next call through a rewritten site closes the window.
 * While it is open, unrewritten sites reach the kernel directly (and so the monitor's
 * seccomp filter), which is correct, only slower.
 *
 * This first step dispatches every call to the kernel unchanged and counts it
 * (LOCKSTEP_FAST=count prints the counts at exit): it proves the interception on real
 * programs and measures its cost. The shared-memory channel between replicas comes next.
 *
 * Limits (see docs/run.md): page 0 is mapped (readable), so a NULL read returns the sled
 * instead of faulting; the `call` writes 8 bytes below the stack pointer (a leaf
 * function's red zone); one thread (SUD is per thread, and rewriting a page another
 * thread executes is not made atomic yet).
 *
 * Built with -mgeneral-regs-only: the trampoline saves only the general registers, so
 * nothing here may touch SSE state the interrupted code expects preserved. No libc
 * function is called on the interception path. */
#define _GNU_SOURCE
#include <link.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#ifndef PR_SET_SYSCALL_USER_DISPATCH
#define PR_SET_SYSCALL_USER_DISPATCH 59
#define PR_SYS_DISPATCH_ON 1
#endif
#define SELECTOR_ALLOW 0
#define SELECTOR_BLOCK 1
#define SI_SYS_USER_DISPATCH 2
#define KSA_RESTORER 0x04000000UL

/* Syscall numbers are below this; the sled covers them. */
#define SLED_LEN 512
#define MAX_NR SLED_LEN

/* The SUD selector: BLOCK sends every syscall from outside this library to SIGSYS. */
static volatile char lf_selector = SELECTOR_ALLOW;
static int lf_active;
static int lf_report;
static unsigned long lf_counts[MAX_NR];
static unsigned long lf_sites;
static unsigned long lf_unrewritable;
static unsigned long lf_windows;

long lf_raw(long nr, long a1, long a2, long a3, long a4, long a5, long a6);
void lf_restorer(void);
void lf_entry(void);

/* The raw syscall and the signal restorer: in this library's text, which SUD lets through.
 * lf_raw takes (nr, a1..a6) in the C ABI and moves them into the syscall ABI. */
__asm__(".text\n"
        ".globl lf_raw\n.type lf_raw,@function\nlf_raw:\n"
        "  mov %rdi, %rax\n  mov %rsi, %rdi\n  mov %rdx, %rsi\n  mov %rcx, %rdx\n"
        "  mov %r8, %r10\n  mov %r9, %r8\n  mov 8(%rsp), %r9\n  syscall\n  ret\n"
        ".globl lf_restorer\n.type lf_restorer,@function\nlf_restorer:\n"
        "  mov $15, %eax\n  syscall\n  hlt\n");

long lf_dispatch(long nr, long a1, long a2, long a3, long a4, long a5, long a6);

/* The trampoline. Entered by `call *%rax` from a rewritten site, through the page-0 sled
 * (r11 held the jump target; the syscall ABI clobbers r11 and rcx anyway). Skips the red
 * zone below the return address, keeps every register the syscall ABI preserves, and
 * returns the result in rax. */
__asm__(".text\n"
        ".globl lf_entry\n.type lf_entry,@function\nlf_entry:\n"
        "  lea -128(%rsp), %rsp\n"
        "  push %rbp\n  mov %rsp, %rbp\n  and $-16, %rsp\n"
        "  push %rdi\n  push %rsi\n  push %rdx\n  push %r10\n  push %r8\n  push %r9\n"
        "  push %rbx\n  push %r9\n"            /* a6 as the 7th C argument, keeps alignment */
        "  mov %r8, %r9\n  mov %r10, %r8\n  mov %rdx, %rcx\n  mov %rsi, %rdx\n"
        "  mov %rdi, %rsi\n  mov %rax, %rdi\n"
        "  call lf_dispatch\n"
        "  add $8, %rsp\n  pop %rbx\n"
        "  pop %r9\n  pop %r8\n  pop %r10\n  pop %rdx\n  pop %rsi\n  pop %rdi\n"
        "  mov %rbp, %rsp\n  pop %rbp\n"
        "  lea 128(%rsp), %rsp\n"
        "  ret\n");

static int never_rewritten(long nr)
{
    return nr == SYS_rt_sigreturn || nr == SYS_clone || nr == SYS_clone3 || nr == SYS_fork ||
           nr == SYS_vfork || nr == SYS_execve || nr == SYS_execveat;
}

long lf_dispatch(long nr, long a1, long a2, long a3, long a4, long a5, long a6)
{
    lf_selector = SELECTOR_BLOCK; /* closes an ALLOW window, if one was open */
    if (nr >= 0 && nr < MAX_NR)
        lf_counts[nr]++;
    return lf_raw(nr, a1, a2, a3, a4, a5, a6);
}

/* Rewrites the `syscall` that ends at `after` into `call *%rax`. Returns 0 on success. */
static int rewrite_site(unsigned char *after)
{
    unsigned char *site = after - 2;
    if (site[0] != 0x0f || site[1] != 0x05)
        return -1;
    uintptr_t page = (uintptr_t)site & ~(uintptr_t)4095;
    size_t len = ((uintptr_t)site + 2 > page + 4096) ? 8192 : 4096;
    if (lf_raw(SYS_mprotect, (long)page, (long)len, PROT_READ | PROT_WRITE | PROT_EXEC, 0, 0, 0) != 0)
        return -1;
    site[0] = 0xff;
    site[1] = 0xd0;
    lf_raw(SYS_mprotect, (long)page, (long)len, PROT_READ | PROT_EXEC, 0, 0, 0);
    lf_sites++;
    return 0;
}

static void on_sigsys(int sig, siginfo_t *info, void *context)
{
    (void)sig;
    ucontext_t *uc = context;
    greg_t *g = uc->uc_mcontext.gregs;
    if (info->si_code != SI_SYS_USER_DISPATCH)
        return;
    long nr = info->si_syscall;
    unsigned char *after = (unsigned char *)g[REG_RIP];
    if (never_rewritten(nr) || nr < 0 || nr >= MAX_NR || rewrite_site(after) != 0) {
        /* Run the original instruction again, with SUD letting it through. */
        lf_unrewritable += !never_rewritten(nr);
        lf_windows++;
        lf_selector = SELECTOR_ALLOW;
        g[REG_RIP] -= 2;
        g[REG_RAX] = nr;
        return;
    }
    g[REG_RAX] = lf_dispatch(nr, g[REG_RDI], g[REG_RSI], g[REG_RDX], g[REG_R10], g[REG_R8], g[REG_R9]);
}

/* Finds this library's executable segment: the range SUD lets through. */
struct text_range {
    uintptr_t inside, start, end;
};

static int find_text(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct text_range *t = data;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD || !(ph->p_flags & PF_X))
            continue;
        uintptr_t start = info->dlpi_addr + ph->p_vaddr;
        if (t->inside >= start && t->inside < start + ph->p_memsz) {
            t->start = start & ~(uintptr_t)4095;
            t->end = start + ph->p_memsz;
            return 1;
        }
    }
    return 0;
}

static void report(void)
{
    if (!lf_report)
        return;
    lf_selector = SELECTOR_ALLOW;
    unsigned long total = 0;
    for (int i = 0; i < MAX_NR; i++)
        total += lf_counts[i];
    char line[160];
    int n = snprintf(line, sizeof line,
                     "lockstep-fast: %lu calls through rewritten sites, %lu sites, %lu windows (%lu unrewritable)\n",
                     total, lf_sites, lf_windows, lf_unrewritable);
    if (n > 0)
        lf_raw(SYS_write, 2, (long)line, n < (int)sizeof line ? n : (int)sizeof line - 1, 0, 0, 0);
}

struct kernel_sigaction {
    void *handler;
    unsigned long flags;
    void *restorer;
    uint64_t mask;
};

__attribute__((constructor)) static void lf_init(void)
{
    const char *mode = getenv("LOCKSTEP_FAST");
    if (mode == NULL || mode[0] == '\0')
        return;
    lf_report = strcmp(mode, "count") == 0;
    /* Page 0: a nop sled for every syscall number, then `movabs $lf_entry, %r11; jmp *%r11`. */
    unsigned char *zero = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (zero != NULL) {
        if (zero != MAP_FAILED)
            munmap(zero, 4096);
        return; /* no page 0 (needs CAP_SYS_RAWIO): stay inert */
    }
    __asm__("" : "+r"(zero)); /* page 0 is a real mapping here, not a null pointer */
    memset(zero, 0x90, SLED_LEN);
    unsigned char *p = zero + SLED_LEN;
    uint64_t target = (uint64_t)(uintptr_t)lf_entry;
    *p++ = 0x49;
    *p++ = 0xbb;
    memcpy(p, &target, 8);
    p += 8;
    *p++ = 0x41;
    *p++ = 0xff;
    *p++ = 0xe3;
    mprotect(zero, 4096, PROT_READ | PROT_EXEC);

    struct text_range text = {.inside = (uintptr_t)lf_dispatch};
    if (dl_iterate_phdr(find_text, &text) != 1)
        return;
    struct kernel_sigaction sa = {
        .handler = (void *)on_sigsys,
        /* SA_NODEFER: a signal handler of the program that runs while this one does (a
         * signal delivered at a call made from here) reaches unrewritten sites too, and
         * a SUD SIGSYS that is blocked is fatal. */
        .flags = SA_SIGINFO | SA_NODEFER | KSA_RESTORER,
        .restorer = (void *)lf_restorer,
        .mask = 0,
    };
    if (lf_raw(SYS_rt_sigaction, SIGSYS, (long)&sa, 0, 8, 0, 0) != 0)
        return;
    if (prctl(PR_SET_SYSCALL_USER_DISPATCH, PR_SYS_DISPATCH_ON, text.start, text.end - text.start, &lf_selector) != 0)
        return;
    atexit(report);
    lf_active = 1;
    lf_selector = SELECTOR_BLOCK;
}
