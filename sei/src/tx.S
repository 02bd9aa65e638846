/* The checkpoint of a handler: _ITM_beginTransaction saves what a restart needs (the
 * callee-saved registers, the caller's stack pointer and the return address) and
 * sei_restart resumes there with another code, the way setjmp/longjmp would. The
 * layout is struct sei_checkpoint in internal.h. No frame pointer is assumed. */
    .text

    .globl _ITM_beginTransaction
    .type _ITM_beginTransaction, @function
_ITM_beginTransaction:
    .cfi_startproc
    leaq 8(%rsp), %rax          /* the caller's stack pointer after return */
    subq $72, %rsp              /* 64 bytes of checkpoint; keeps %rsp 16-aligned */
    .cfi_adjust_cfa_offset 72
    movq %rax, 0(%rsp)
    movq %rbx, 8(%rsp)
    movq %rbp, 16(%rsp)
    movq %r12, 24(%rsp)
    movq %r13, 32(%rsp)
    movq %r14, 40(%rsp)
    movq %r15, 48(%rsp)
    movq 72(%rsp), %rax         /* the return address */
    movq %rax, 56(%rsp)
    movq %rsp, %rsi
    call sei_tx_begin           /* (props, checkpoint) -> the code to return */
    addq $72, %rsp
    .cfi_adjust_cfa_offset -72
    ret
    .cfi_endproc
    .size _ITM_beginTransaction, .-_ITM_beginTransaction

    .globl sei_restart
    .hidden sei_restart
    .type sei_restart, @function
sei_restart:
    .cfi_startproc
    movl %esi, %eax
    movq 8(%rdi), %rbx
    movq 16(%rdi), %rbp
    movq 24(%rdi), %r12
    movq 32(%rdi), %r13
    movq 40(%rdi), %r14
    movq 48(%rdi), %r15
    movq 56(%rdi), %rcx
    movq 0(%rdi), %rsp
    jmp *%rcx
    .cfi_endproc
    .size sei_restart, .-sei_restart

    .section .note.GNU-stack,"",@progbits
