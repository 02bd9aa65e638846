/* The out-of-line lockstep_trace(); see include/lockstep.h. */
#include "include/lockstep.h"

#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

void lockstep_trace(const void *buf, size_t len)
{
    int saved = errno; /* outside lockstep the call fails with ENOSYS: keep errno */
    syscall(LOCKSTEP_SYS_TRACE, buf, len);
    errno = saved;
}
