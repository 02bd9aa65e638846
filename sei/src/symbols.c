/* Whether an address is the start of a function of the program, by the ELF symbol
 * tables of the object that holds it. A handler that calls through a pointer needs the
 * callee's transactional clone; when there is none, the answer tells the two causes
 * apart: a function that is not SEI_SAFE (the program's mistake, the same in every run)
 * or a pointer that is no function at all (a fault corrupted it). Used only on that
 * failure path, so it may read files. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* Searches the file's .symtab (all symbols, static ones included) and .dynsym for a
 * function that starts at `offset` (the address less the object's load bias), or with
 * `function` 0, a data object that holds it (`*delta`: how far into it). Returns 1 and
 * copies its name, 0 when the tables have none there, -1 when the file has no symbol
 * table to say (stripped, unreadable). */
static int symbol_at(const char *path, uintptr_t offset, int function, char *name, size_t name_size,
                     uintptr_t *delta) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < (off_t)sizeof(Elf64_Ehdr)) {
        close(fd);
        return -1;
    }
    size_t size = (size_t)st.st_size;
    const unsigned char *file = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (file == MAP_FAILED) return -1;
    int found = -1;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)file;
    /* every offset and count from the file is checked against its size before use */
    if (memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 || eh->e_ident[EI_CLASS] != ELFCLASS64 ||
        eh->e_shentsize != sizeof(Elf64_Shdr) || eh->e_shoff > size ||
        (size - eh->e_shoff) / sizeof(Elf64_Shdr) < eh->e_shnum)
        goto out;
    const Elf64_Shdr *sections = (const Elf64_Shdr *)(file + eh->e_shoff);
    for (unsigned i = 0; i < eh->e_shnum; i++) {
        const Elf64_Shdr *sh = &sections[i];
        if (sh->sh_type != SHT_SYMTAB && sh->sh_type != SHT_DYNSYM) continue;
        if (sh->sh_link >= eh->e_shnum || sh->sh_entsize != sizeof(Elf64_Sym) || sh->sh_offset > size ||
            sh->sh_size > size - sh->sh_offset)
            continue;
        const Elf64_Shdr *strtab = &sections[sh->sh_link];
        if (strtab->sh_offset > size || strtab->sh_size > size - strtab->sh_offset) continue;
        /* .dynsym alone lists only exported functions: its silence proves nothing */
        if (found < 0 && sh->sh_type == SHT_SYMTAB) found = 0;
        const Elf64_Sym *syms = (const Elf64_Sym *)(file + sh->sh_offset);
        for (size_t k = 0; k < sh->sh_size / sizeof(Elf64_Sym); k++) {
            const Elf64_Sym *sym = &syms[k];
            int match = function ? ELF64_ST_TYPE(sym->st_info) == STT_FUNC && sym->st_value == offset
                                 : ELF64_ST_TYPE(sym->st_info) == STT_OBJECT && offset >= sym->st_value &&
                                       offset - sym->st_value < sym->st_size;
            if (!match) continue;
            *delta = offset - sym->st_value;
            const char *s = (const char *)file + strtab->sh_offset;
            size_t at = sym->st_name;
            size_t room = strtab->sh_size;
            size_t n = 0;
            while (at + n < room && s[at + n] != 0 && n + 1 < name_size) n++;
            memcpy(name, s + at, n);
            name[n] = 0;
            found = 1;
            goto out;
        }
    }
out:
    munmap((void *)(uintptr_t)file, size);
    return found;
}

/* Whether fn lies in an executable mapping of the process (/proc/self/maps). */
static int executable(const void *fn) {
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 1; /* cannot tell: assume code */
    char buf[4096], line[512];
    size_t len = 0;
    int answer = 0;
    for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) {
        for (ssize_t i = 0; i < n; i++) {
            if (buf[i] != '\n') {
                if (len + 1 < sizeof line) line[len++] = buf[i];
                continue;
            }
            line[len] = 0;
            len = 0;
            unsigned long lo = 0, hi = 0;
            char perms[5] = {0};
            char *end;
            lo = strtoul(line, &end, 16);
            if (*end != '-') continue;
            hi = strtoul(end + 1, &end, 16);
            if (*end != ' ') continue;
            memcpy(perms, end + 1, 4);
            if ((uintptr_t)fn >= lo && (uintptr_t)fn < hi) {
                answer = perms[2] == 'x';
                goto done;
            }
        }
    }
done:
    close(fd);
    return answer;
}

/* The file of a loaded object; the main program's name is "" in its link map. */
static const char *object_path(const struct link_map *map) {
    return map->l_name != NULL && map->l_name[0] != 0 ? map->l_name : "/proc/self/exe";
}

void sei_data_symbol(const void *addr, char *out, size_t out_size) {
    Dl_info info;
    struct link_map *map = NULL;
    char name[128];
    uintptr_t delta = 0;
    out[0] = 0;
    if (dladdr1(addr, &info, (void **)&map, RTLD_DL_LINKMAP) == 0 || map == NULL) return;
    if (symbol_at(object_path(map), (uintptr_t)addr - map->l_addr, 0, name, sizeof name, &delta) == 1)
        snprintf(out, out_size, "%s+%lu", name, (unsigned long)delta);
}

int sei_is_function(const void *fn, char *name, size_t name_size) {
    Dl_info info;
    struct link_map *map = NULL;
    name[0] = 0;
    if (dladdr1(fn, &info, (void **)&map, RTLD_DL_LINKMAP) == 0 || map == NULL)
        return 0; /* in no loaded object: not code */
    uintptr_t delta;
    int found = symbol_at(object_path(map), (uintptr_t)fn - map->l_addr, 1, name, name_size, &delta);
    if (found < 0) { /* stripped: an exported symbol there, or at least code */
        if (info.dli_saddr == fn && info.dli_sname != NULL) {
            size_t n = strnlen(info.dli_sname, name_size - 1);
            memcpy(name, info.dli_sname, n);
            name[n] = 0;
            return 1;
        }
        return executable(fn) ? 2 : 0;
    }
    return found;
}
