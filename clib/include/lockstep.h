/* lockstep.h: let a program add its own critical data to lockstep's signature.
 *
 * Under `lockstep run`, lockstep_trace(buf, len) folds the bytes into the calling
 * replica's running signature (like RCoE's FT_Add_Trace), so a replica whose data differs
 * is caught at the next vote even if it produces no different output yet. Outside
 * lockstep it does nothing: it issues a syscall number no kernel implements, which
 * fails with ENOSYS.
 *
 * Link with liblockstep.a (built by `make clib`), or use the inline version below by
 * defining LOCKSTEP_TRACE_INLINE before including this header.
 */
#ifndef LOCKSTEP_H
#define LOCKSTEP_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Keep in sync with lockstep_trace::SYS_LOCKSTEP_TRACE. */
#define LOCKSTEP_SYS_TRACE 0x4c53

#ifdef LOCKSTEP_TRACE_INLINE
#include <unistd.h>
#include <sys/syscall.h>
static inline void lockstep_trace(const void *buf, size_t len)
{
    syscall(LOCKSTEP_SYS_TRACE, buf, len);
}
#else
void lockstep_trace(const void *buf, size_t len);
#endif

#ifdef __cplusplus
}
#endif

#endif
